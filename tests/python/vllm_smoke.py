"""vLLM's CPU build, offline, greedy, on the model folder scripts/vllm-env makes: prints one
JSON object with the prompt's token ids and the generated ones, for a caller to compare
with kvfence's own monolithic path of the same model.

    python tests/python/vllm_smoke.py MODEL_DIR "PROMPT" MAX_TOKENS
"""
import json
import os
import sys


def main():
    model, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=4)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    print(json.dumps({"prompt_ids": list(out.prompt_token_ids),
                      "ids": list(out.outputs[0].token_ids),
                      "text": out.outputs[0].text}))


if __name__ == "__main__":  # vLLM spawns its engine and worker processes
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
