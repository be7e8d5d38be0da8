#!/usr/bin/env bash
# Cross-checks kvfence's Llama runner against vLLM's CPU build on the same model: the
# prompts of llama/tests/fixtures/crosscheck_prompts.json, the same token ids fed to both,
# greedy decoding of up to 32 tokens. vLLM runs the folder scripts/vllm-env converts from
# the same GGUF (weights dequantized to float32, as kvfence dequantizes them). Prints, per
# prompt, whether the outputs are identical and, at the first divergence, both tokens and
# kvfence's top-two logit margin there; then a summary line.
#
#   scripts/crosscheck-vllm.sh        # installs vLLM first if needed (scripts/vllm-env)
set -euo pipefail
cd "$(dirname "$0")/.."
{ read -r py; read -r model_dir; } < <(scripts/vllm-env)
model=$(scripts/fetch-model)
ours=$(mktemp "${TMPDIR:-/tmp}/kvfence-crosscheck.XXXXXX")
# vLLM spawns its engine in processes that import the script again: it must be a file.
script=$(mktemp "${TMPDIR:-/tmp}/kvfence-crosscheck-vllm.XXXXXX.py")
trap 'rm -f "$ours" "$script"' EXIT
KVFENCE_MODEL=$model KVFENCE_CROSSCHECK_OUT=$ours \
  cargo test --release --quiet -p llama --test crosscheck -- --ignored >/dev/null
cat > "$script" <<'PY'
import json, sys


def main():
    from vllm import LLM, SamplingParams
    model_dir, ours = sys.argv[1:]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=4)
    tok = llm.get_tokenizer()
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    stops.discard(None)
    ks = [json.loads(line) for line in open(ours)]
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=sorted(stops))
    outs = llm.generate([{"prompt_token_ids": k["prompt_tokens"]} for k in ks], params,
                        use_tqdm=False)
    same, notes = 0, []
    for k, o in zip(ks, outs):
        theirs = [t for t in o.outputs[0].token_ids]
        while theirs and theirs[-1] in stops:
            theirs.pop()
        ours_t = k["tokens"]
        if ours_t == theirs:
            same += 1
            print(f"{k['name']:>10}: identical ({len(ours_t)} tokens): {k['text']!r}")
            continue
        i = next((i for i, (a, b) in enumerate(zip(ours_t, theirs)) if a != b),
                 min(len(ours_t), len(theirs)))
        a = ours_t[i] if i < len(ours_t) else "stop"
        b = theirs[i] if i < len(theirs) else "stop"
        note = f"{k['name']} at step {i}: kvfence {a} (margin {k['margins'][i]:.3f}), vLLM {b}"
        notes.append(note)
        print(f"{k['name']:>10}: DIVERGES {note}")
        print(f"{'':>12}kvfence: {k['text']!r}")
        print(f"{'':>12}vLLM:    {o.outputs[0].text!r}")
    print(f"crosscheck: {same}/{len(ks)} prompts identical"
          + (f"; divergences: {'; '.join(notes)}" if notes else ""))


if __name__ == "__main__":  # vLLM spawns its engine and worker processes
    main()
PY
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \
  "$py" "$script" "$model_dir" "$ours" 2>/dev/null
