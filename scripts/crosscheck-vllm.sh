#!/usr/bin/env bash
# Cross-checks kvfence's Llama runner against vLLM's CPU build on the same model: the
# prompts of llama/tests/fixtures/crosscheck_prompts.json, the same token ids fed to both,
# greedy decoding of up to 32 tokens. vLLM runs the folder scripts/vllm-env converts from
# the same GGUF (weights dequantized to float32, as kvfence's f32 decode runs). Prints, per
# prompt, whether the outputs are identical and, at the first divergence, both tokens and
# kvfence's top-two logit margin there; then a summary line.
#
#   scripts/crosscheck-vllm.sh        # installs vLLM first if needed (scripts/vllm-env)
#   KVFENCE_CROSSCHECK_DECODE=f32 scripts/crosscheck-vllm.sh   # kvfence's f32 decode
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
    sys.path.insert(0, sys.argv[1])
    from crosscheck_report import Report
    model_dir, ours = sys.argv[2:]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=4)
    tok = llm.get_tokenizer()
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    stops.discard(None)
    ks = [json.loads(line) for line in open(ours)]
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=sorted(stops))
    outs = llm.generate([{"prompt_token_ids": k["prompt_tokens"]} for k in ks], params,
                        use_tqdm=False)
    report = Report("vLLM")
    for k, o in zip(ks, outs):
        theirs = list(o.outputs[0].token_ids)
        while theirs and theirs[-1] in stops:
            theirs.pop()
        report.compare(k, theirs, o.outputs[0].text)
    report.summary()


if __name__ == "__main__":  # vLLM spawns its engine and worker processes
    main()
PY
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \
  "$py" "$script" "$PWD/scripts" "$model_dir" "$ours" 2>/dev/null
