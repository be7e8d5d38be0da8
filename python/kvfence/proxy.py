"""The OpenAI-compatible front of a prefill vLLM and a decode vLLM that share KV through
kvfence.

    python -m kvfence.proxy --listen 127.0.0.1:8000 --kvctld /run/kvfence/kvctld.sock \\
        --prefill http://127.0.0.1:8100 --decode decode-0=http://127.0.0.1:8200

For ``POST /v1/completions``:

1. the prompt becomes token ids (the prefill vLLM's ``/tokenize``);
2. kvctld admits it — prefill pages for the prompt and decode pages for prompt plus
   ``max_tokens``, both or neither — and runs prefill, transfer and verification. A request
   kvctld rejects (longer than the pools' context, say) is answered 400 here, and no vLLM
   ever sees it: no placeholder, no KV moved;
3. the decode vLLM that holds the verified KV (kvctld names its worker) generates, loading
   that KV instead of recomputing it; its answer, streamed or not, goes to the client.

Any other failure is a clear error: 503 for no room now (retry), 502 when the transfer
failed verification, 504 for a deadline. ``kv_transfer_params`` from clients are dropped:
only the proxy names an owner. The tenant is the ``X-Kvfence-Tenant`` header, or "default".
"""

import argparse
import asyncio
import json
import re
import time

from aiohttp import ClientSession, ClientTimeout, web

from . import Client, KvfenceError

# kvctld's error codes and the HTTP status each becomes.
STATUS = {
    "Rejected": 400,
    "BadRequest": 400,
    "PoolFull": 503,
    "ShuttingDown": 503,
    "Timeout": 504,
    "VerifyFailed": 502,
    "WorkerLost": 502,
}
TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": code}}, status=status
    )


class Proxy:
    def __init__(self, kvctld: str, prefill: str, decode: dict, deadline_ms: int):
        self.kvctld = kvctld
        self.prefill = prefill.rstrip("/")
        self.decode = {k: v.rstrip("/") for k, v in decode.items()}
        self.deadline_ms = deadline_ms
        self.session = None

    async def start(self, app):
        self.session = ClientSession(timeout=ClientTimeout(total=600))

    async def stop(self, app):
        await self.session.close()

    async def tokenize(self, prompt) -> list:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string or a list of token ids")
        async with self.session.post(self.prefill + "/tokenize", json={"prompt": prompt}) as r:
            if r.status != 200:
                raise ValueError(f"tokenizing: {r.status} {await r.text()}")
            return (await r.json())["tokens"]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = time.time_ns() // 1000
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            tokens = await self.tokenize(body.get("prompt"))
            max_tokens = int(body.get("max_tokens") or 16)
            if not 1 <= max_tokens < 2**32:
                raise ValueError("max_tokens must be a positive integer")
            if not tokens or not all(0 <= t < 2**32 for t in tokens):
                raise ValueError("the prompt must be non-empty and its token ids in 0..2^32")
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
            return error(400, str(e), "bad_request")
        tenant = request.headers.get("X-Kvfence-Tenant", "default")
        if not TENANT.match(tenant):
            return error(400, "X-Kvfence-Tenant must be 1-64 of [A-Za-z0-9_.-]", "bad_request")
        client = Client(self.kvctld)
        try:
            admitted = await asyncio.get_running_loop().run_in_executor(
                None, client.generate, tenant, tokens, max_tokens, self.deadline_ms
            )
        except KvfenceError as e:
            code, message = e.args
            return error(STATUS.get(code, 500), f"kvfence: {message}", code)
        verified = time.time_ns() // 1000
        url = self.decode.get(admitted["decode_worker"])
        if url is None:
            return error(500, f"no decode vLLM for worker {admitted['decode_worker']!r}", "Internal")
        owner = {"request": admitted["request"], "generation": admitted["generation"]}
        body.pop("kv_transfer_params", None)
        body["prompt"] = tokens
        body["max_tokens"] = max_tokens
        body["kv_transfer_params"] = {"kvfence": owner}
        async with self.session.post(url + "/v1/completions", json=body) as r:
            headers = {
                "Content-Type": r.headers.get("Content-Type", "application/json"),
                "X-Kvfence-Request": f"{owner['request']}/{owner['generation']}",
                "X-Kvfence-Received-Us": str(received),
                "X-Kvfence-Verified-Us": str(verified),
                "X-Kvfence-Pages": str(admitted["pages"]),
            }
            out = web.StreamResponse(status=r.status, headers=headers)
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:8000")
    ap.add_argument("--kvctld", required=True, help="kvctld's Unix socket")
    ap.add_argument("--prefill", required=True, help="the prefill vLLM's URL (tokenizing)")
    ap.add_argument("--decode", action="append", required=True, metavar="WORKER=URL",
                    help="a decode worker id and the vLLM it runs in")
    ap.add_argument("--deadline-ms", type=int, default=0, help="0: kvctld's default")
    args = ap.parse_args()
    decode = dict(d.split("=", 1) for d in args.decode)
    proxy = Proxy(args.kvctld, args.prefill, decode, args.deadline_ms)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    host, port = args.listen.rsplit(":", 1)
    web.run_app(app, host=host, port=int(port), print=None)


if __name__ == "__main__":
    main()
