#!/usr/bin/env bash
# Cross-checks kvfence's Llama runner against an independent implementation, llama.cpp
# (its Python binding, llama-cpp-python, built from source into a virtual environment):
# the prompts of llama/tests/fixtures/crosscheck_prompts.json, the same token ids fed to
# both (so tokenization is not a variable; llama/tests/tokenizer.rs checks it separately),
# greedy decoding of up to 32 tokens on the model of scripts/fetch-model. Prints, per
# prompt, whether the outputs are identical and, at the first divergence, both tokens and
# the top-two logit margin of each side there; then a summary line.
#
#   scripts/crosscheck-llamacpp.sh            # venv in target/llamacpp-venv ($LLAMACPP_VENV)
#   KVFENCE_CROSSCHECK_DECODE=f32 scripts/crosscheck-llamacpp.sh   # kvfence's f32 decode
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${LLAMACPP_VENV:-target/llamacpp-venv}
model=$(scripts/fetch-model)
scripts/llamacpp-env >/dev/null  # builds llama.cpp's binding into $venv if missing

ours=$(mktemp "${TMPDIR:-/tmp}/kvfence-crosscheck.XXXXXX")
trap 'rm -f "$ours"' EXIT
KVFENCE_MODEL=$model KVFENCE_CROSSCHECK_OUT=$ours \
  cargo test --release --quiet -p llama --test crosscheck -- --ignored >/dev/null

"$venv/bin/python" - "$PWD/scripts" "$model" "$ours" <<'PY'
import json, sys
import numpy as np
from llama_cpp import Llama

sys.path.insert(0, sys.argv[1])
from crosscheck_report import Report

model, ours = sys.argv[2:]
llm = Llama(model_path=model, n_ctx=2048, n_threads=2, n_batch=512, logits_all=True,
            verbose=False)
stops = {llm.token_eos()}
im_end = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)
if len(im_end) == 1:
    stops.add(im_end[0])
report = Report("llama.cpp")
for line in open(ours):
    k = json.loads(line)
    llm.reset()
    llm.eval(k["prompt_tokens"])
    theirs, margins = [], []
    for _ in range(32):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.argsort(-logits, kind="stable")[:2]
        margins.append(float(logits[top[0]] - logits[top[1]]))
        t = int(top[0])
        if t in stops:
            break
        theirs.append(t)
        llm.eval([t])
    report.compare(k, theirs, llm.detokenize(theirs).decode("utf-8", "replace"), margins)
report.summary()
PY
