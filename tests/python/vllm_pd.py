"""kvfence under vLLM, end to end: a prefill vLLM and a decode vLLM (vLLM's CPU build) that
move KV through kvfence, behind ``kvfence.proxy``, against a single vLLM of the same model.

    python tests/python/vllm_pd.py BIN_DIR MODEL_DIR WORK_DIR

BIN_DIR holds kvctld; the kvfence wheel (built with the fault-injection feature) is installed
in this interpreter. Checks, in order, each failing the run with a message:

1. fault: the prefill worker flips a bit of the first request's first page after its digest
   (KVFENCE_FAULT=corrupt-page-once): that request fails with 502 VerifyFailed and the decode
   vLLM never gets it;
2. the prompts of tests/python/vllm_prompts.json (several over 128 tokens, over many 32-token
   blocks): greedy outputs through kvfence equal the single vLLM's, token for token;
3. the incident: a prompt longer than the pools' context gets 400, neither vLLM sees it, no
   KV moves; then other tenants' requests are still correct;
4. transfer + verify as a share of time to first token, printed as a JSON line
   (``{"ttft": ...}``) for the README.

Every process it starts is stopped at the end, whatever happens.
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
MAX_CONTEXT = 384
MAX_NEW = 24
STARTUP_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, headers=None, timeout=300):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def wait_for(cond, seconds):
    """Whether `cond()` holds within `seconds` (polled)."""
    deadline = time.time() + seconds
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def counter(metrics_text: str, name: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Stack:
    def __init__(self, bins, model, work):
        self.bins, self.model, self.work = bins, model, work
        self.procs = []
        self.sock = os.path.join(work, "kvctld.sock")
        self.config = os.path.join(work, "kvfence.toml")
        self.timings = os.path.join(work, "timings.jsonl")
        pages_prefill = 2 * MAX_CONTEXT // 16
        pages_decode = 2 * (MAX_CONTEXT + MAX_NEW + 15) // 16
        with open(self.config, "w") as f:
            f.write(f"""[geometry]
tokens_per_page = 16
layers = 30
kv_heads = 3
head_dim = 64
dtype = "f32"

[limits]
max_context = {MAX_CONTEXT}
max_new_tokens = {MAX_NEW}

[control]
socket = "{self.sock}"

[model]
kind = "engine"

[prefill]
pool_pages = {pages_prefill}

[decode]
pool_pages = {pages_decode}
max_batch = 4

[deadlines]
prefill = 60000
decode = 30000
request = 120000
""")

    def spawn(self, name, argv, env=None):
        log = open(os.path.join(self.work, f"{name}.log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, p))
        return p

    def vllm(self, name, port, role=None, worker_id=None, env=None):
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--served-model-name", "smollm2",
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "2048", "--block-size", str(BLOCK),
                "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "8"]
        if role is not None:
            extra = {"config": self.config, "worker_id": worker_id}
            if role == "kv_producer":
                extra["engine_url"] = f"http://127.0.0.1:{port}"
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvfenceConnector",
                "kv_connector_module_path": "kvfence.connector",
                "kv_role": role, "kv_connector_extra_config": extra})]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "KVFENCE_TIMINGS": self.timings, **(env or {})}
        return self.spawn(name, argv, env)

    def wait_ready(self, name, url):
        deadline = time.time() + STARTUP_S
        proc = dict(self.procs)[name]
        while time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited ({proc.returncode}); see {name}.log:\n" +
                                 open(os.path.join(self.work, f"{name}.log")).read()[-3000:])
            try:
                get(url)
                return
            except OSError:
                time.sleep(1)
        raise SystemExit(f"{name} not ready within {STARTUP_S} s")

    def stop(self):
        for name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def completion(url, prompt, tenant, max_tokens=MAX_NEW):
    return post(url + "/v1/completions",
                {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                 "temperature": 0, "logprobs": 0},
                headers={"X-Kvfence-Tenant": tenant})


def tokens_of(reply):
    """The generated text (greedy: the same tokens give the same text; the callers compare
    the completion token counts too)."""
    choice = reply["choices"][0]
    return choice["text"]


def ttft(url, prompt, tenant):
    """Seconds from sending a streamed request to its first token, and the response headers."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                         "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "X-Kvfence-Tenant": tenant},
    )
    sent = time.time_ns() // 1000
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text"' in line:
                first = time.time_ns() // 1000
                r.read()
                return sent, first, dict(r.headers)
    raise SystemExit("a streamed reply without tokens")


def main():
    bins, model, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    prompts = json.load(open(os.path.join(HERE, "vllm_prompts.json")))
    stack = Stack(bins, model, work)
    ports = {n: free_port() for n in ("single", "prefill", "decode", "proxy")}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    failures = []
    try:
        stack.spawn("kvctld", [os.path.join(bins, "kvctld"), "--config", stack.config],
                    env={"RUST_LOG": "info"})
        stack.vllm("single", ports["single"])
        stack.vllm("prefill", ports["prefill"], "kv_producer", "prefill-0",
                   env={"KVFENCE_FAULT": "corrupt-page-once", "RUST_LOG": "info"})
        stack.vllm("decode", ports["decode"], "kv_consumer", "decode-0", env={"RUST_LOG": "info"})
        stack.spawn("proxy", [sys.executable, "-m", "kvfence.proxy", "--listen",
                              f"127.0.0.1:{ports['proxy']}", "--kvctld", stack.sock,
                              "--prefill", urls["prefill"], "--decode", f"decode-0={urls['decode']}"])
        for n in ("single", "prefill", "decode"):
            stack.wait_ready(n, urls[n] + "/health")
        # proxy has no /health: any answer to a GET shows it listens (405/404)
        deadline = time.time() + 60
        while True:
            try:
                get(urls["proxy"] + "/")
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("proxy not listening")
                time.sleep(0.5)
        print("stack up", flush=True)

        # 1. a page corrupted after its digest: this request fails, closed.
        decode_before = counter(get(urls["decode"] + "/metrics"), "vllm:prompt_tokens_total")
        status, body, _ = completion(urls["proxy"], prompts[0], "tenant-a")
        decode_after = counter(get(urls["decode"] + "/metrics"), "vllm:prompt_tokens_total")
        code = body.get("error", {}).get("code")
        print(f"corrupted page: {status} {code}: {body.get('error', {}).get('message')}")
        if status != 502 or code != "VerifyFailed":
            failures.append(f"the corrupted request got {status} {body}, not 502 VerifyFailed")
        if decode_after != decode_before:
            failures.append("the decode vLLM saw the corrupted request")

        # 2. every prompt through kvfence equals the single vLLM.
        same = 0
        for i, prompt in enumerate(prompts):
            s1, want, _ = completion(urls["single"], prompt, "tenant-a")
            s2, got, h = completion(urls["proxy"], prompt, f"tenant-{'ab'[i % 2]}")
            if s1 != 200 or s2 != 200:
                failures.append(f"prompt {i}: single {s1}, through kvfence {s2}: {got}")
                continue
            n = want["usage"]["prompt_tokens"]
            ok = tokens_of(want) == tokens_of(got) and \
                want["usage"]["completion_tokens"] == got["usage"]["completion_tokens"]
            same += ok
            print(f"prompt {i}: {n} tokens ({-(-n // BLOCK)} blocks, {h.get('X-Kvfence-Pages')} "
                  f"kvfence pages): {'same' if ok else 'DIFFERENT'}", flush=True)
            if not ok:
                failures.append(f"prompt {i}: {tokens_of(want)!r} != {tokens_of(got)!r}")
        print(f"{same}/{len(prompts)} equal the single vLLM")

        # 3. the incident: too long for the pools' context.
        long_prompt = " ".join(["history"] * (MAX_CONTEXT + 50))
        m_prefill = counter(get(urls["prefill"] + "/metrics"), "vllm:prompt_tokens_total")
        m_decode = counter(get(urls["decode"] + "/metrics"), "vllm:prompt_tokens_total")
        lines_before = sum(1 for _ in open(stack.timings)) if os.path.exists(stack.timings) else 0
        status, body, _ = completion(urls["proxy"], long_prompt, "tenant-long")
        print(f"over-long prompt: {status} {body.get('error', {}).get('message')}")
        if status != 400 or body.get("error", {}).get("code") != "Rejected":
            failures.append(f"the over-long prompt got {status} {body}, not 400 Rejected")
        s_single, _, _ = completion(urls["single"], long_prompt, "tenant-long", max_tokens=1)
        if s_single != 200:
            failures.append(f"the single vLLM refused the long prompt itself ({s_single}): "
                            "the replay would not show kvfence's rejection")
        time.sleep(1)
        if counter(get(urls["prefill"] + "/metrics"), "vllm:prompt_tokens_total") != m_prefill \
                or counter(get(urls["decode"] + "/metrics"), "vllm:prompt_tokens_total") != m_decode:
            failures.append("a vLLM computed tokens for the rejected request")
        lines_after = sum(1 for _ in open(stack.timings)) if os.path.exists(stack.timings) else 0
        if lines_after != lines_before:
            failures.append("KV moved for the rejected request")
        for i, tenant in ((1, "tenant-c"), (2, "tenant-d")):
            _, want, _ = completion(urls["single"], prompts[i], tenant)
            s, got, _ = completion(urls["proxy"], prompts[i], tenant)
            if s != 200 or tokens_of(want) != tokens_of(got):
                failures.append(f"after the rejection, {tenant}'s request: {s} {got}")
        print("after the rejection: other tenants' requests checked")

        # Garbage at the proxy: a clear 400 each, and it keeps serving (the next checks).
        for bad in ({"model": "smollm2", "prompt": [-1, 5], "max_tokens": 4},
                    {"model": "smollm2", "prompt": "hi", "max_tokens": -3},
                    {"model": "smollm2", "prompt": {"x": 1}}, [1, 2]):
            s, body, _ = post(urls["proxy"] + "/v1/completions", bad)
            if s != 400:
                failures.append(f"the proxy answered {bad!r} with {s} {body}, not 400")
        print("garbage at the proxy: 400s")

        # 4. a request at the decode vLLM itself naming an owner whose KV decoded never
        # verified (kvctld never admitted it): its blocks fail to load and it errors; it
        # never decodes from them.
        forged = {"model": "smollm2", "prompt": prompts[4], "max_tokens": MAX_NEW,
                  "temperature": 0,
                  "kv_transfer_params": {"kvfence": {"request": 987654321, "generation": 1}}}
        s, body, _ = post(urls["decode"] + "/v1/completions", forged)
        print(f"forged owner at the decode vLLM: {s} {json.dumps(body)[:200]}")
        log = os.path.join(stack.work, "decode.log")
        if s == 200:
            failures.append(f"the decode vLLM answered a forged owner: {body}")
        elif not wait_for(lambda: "due to KV load failure" in open(log).read(), 10):
            failures.append(f"the forged owner's {s} is not vLLM's KV load failure ({log})")

        # 4. transfer + verify as a share of time to first token.
        shares, ttfts, handoffs = [], [], []
        for i, prompt in enumerate(prompts):
            sent, first, h = ttft(urls["proxy"], prompt, "tenant-t")
            req, gen = map(int, h["X-Kvfence-Request"].split("/"))
            events = [json.loads(l) for l in open(stack.timings)]
            mine = [e for e in events if e.get("request") == req and e.get("generation") == gen]
            delivered = next(e["delivered_unix_us"] for e in mine if "delivered_unix_us" in e)
            loaded = next(e for e in mine if "exported_unix_us" in e)
            handoff = loaded["exported_unix_us"] - delivered + loaded["load_us"]
            shares.append(handoff / (first - sent))
            ttfts.append((first - sent) / 1000)
            handoffs.append(handoff / 1000)
        print(json.dumps({"ttft": {
            "requests": len(shares),
            "ttft_ms_median": round(statistics.median(ttfts), 1),
            "transfer_verify_ms_median": round(statistics.median(handoffs), 2),
            "share_median": round(statistics.median(shares), 4),
            "share_max": round(max(shares), 4)}}))
    finally:
        stack.stop()
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
