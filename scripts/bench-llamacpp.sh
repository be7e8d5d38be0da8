#!/usr/bin/env bash
# The llama runner against llama.cpp on the same model (SmolLM2-135M-Instruct, Q4_1), the
# same prompt length and the same threads, in one run: rounds alternate kvfence and
# llama.cpp (its Python binding, llama-cpp-python, in a virtual environment) on 1 and on 2
# threads. Each round measures prefill of a 512-token prompt and 64 greedy decode steps
# after it; kvfence's rounds also decode with the f32 weights, and 16 requests of 128 tokens
# together against one alone. Prints every round as a JSON line, then tables of medians with
# the ratios kvfence / llama.cpp, blocks / f32 and together / one.
#
#   scripts/bench-llamacpp.sh [ROUNDS]   # default 3; venv as scripts/crosscheck-llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-3}
venv=${LLAMACPP_VENV:-target/llamacpp-venv}
model=$(scripts/fetch-model)
scripts/llamacpp-env >/dev/null  # builds llama.cpp's binding into $venv if missing
cargo build --release --quiet -p kvfence-tests --bin kvllmbench

llamacpp() { # threads
  "$venv/bin/python" - "$model" "$1" <<'PY'
import json, sys, time
import numpy as np
from llama_cpp import Llama

model, threads = sys.argv[1], int(sys.argv[2])
prompt_len, decode = 512, 64
# n_batch as large as the context: the binding keeps the last logits at the token's
# position in a buffer of n_batch rows (logits_all would compute every prompt token's).
ctx = prompt_len + decode + 16
llm = Llama(model_path=model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
            n_batch=ctx, n_ubatch=prompt_len, verbose=False)
text = "The quick brown fox jumps over the lazy dog, and the river runs past the old mill. "
ids = llm.tokenize((text * 64).encode(), add_bos=False)[:prompt_len]
llm.reset()
t = time.perf_counter()
llm.eval(ids)
prefill_s = time.perf_counter() - t
t = time.perf_counter()
for _ in range(decode):
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([tok])
decode_s = time.perf_counter() - t
print(json.dumps({"impl": "llama.cpp", "threads": threads, "prompt": len(ids),
                  "prefill_tok_s": round(len(ids) / prefill_s, 1), "decode": decode,
                  "decode_tok_s": round(decode / decode_s, 2)}))
PY
}

lines=$(mktemp "${TMPDIR:-/tmp}/kvfence-bench.XXXXXX")
trap 'rm -f "$lines"' EXIT
for r in $(seq 1 "$rounds"); do
  for t in 1 2; do
    target/release/kvllmbench runner --threads "$t" --prompt 512 --decode 64 | tee -a "$lines"
    llamacpp "$t" | tee -a "$lines"
  done
done

python3 - "$lines" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n| threads | what | kvfence | llama.cpp | kvfence / llama.cpp |")
print("| ---: | --- | ---: | ---: | ---: |")
for t in (1, 2):
    for key, what in (("prefill_tok_s", "prefill, 512 tokens (tok/s)"),
                      ("decode_tok_s", "decode, 64 steps (tok/s)")):
        k = statistics.median(r[key] for r in rows if r["impl"] == "kvfence" and r["threads"] == t)
        l = statistics.median(r[key] for r in rows if r["impl"] == "llama.cpp" and r["threads"] == t)
        print(f"| {t} | {what} | {k:.1f} | {l:.1f} | {k / l:.2f} |")
# kvfence alone: decode with the f32 weights (before the block kernels), and 16 requests
# decoded together against one of them alone (prompts of 128 tokens), same rounds.
print("\n| threads | kvfence decode, f32 weights (tok/s) | blocks / f32 | one request (tok/s) "
      "| 16 together (tok/s, all) | together / one |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for t in (1, 2):
    mine = [r for r in rows if r["impl"] == "kvfence" and r["threads"] == t]
    med = lambda key: statistics.median(r[key] for r in mine)
    print(f"| {t} | {med('decode_f32_tok_s'):.1f} | {med('decode_tok_s') / med('decode_f32_tok_s'):.2f} "
          f"| {med('one_tok_s'):.1f} | {med('batch_tok_s'):.1f} "
          f"| {statistics.median(r['batch_tok_s'] / r['one_tok_s'] for r in mine):.2f} |")
PY
