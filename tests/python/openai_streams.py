"""Many concurrent streams through openaid with the official `openai` package (its async
client): tests/tests/openai.rs runs this and checks every answer against the monolithic
path of the same model.

    openai_streams.py BASE_URL MODEL STREAMS MAX_TOKENS PROMPT...

Stream `i` sends PROMPT number `i % len(PROMPTS)`, as a chat message when `i % 8 == 1` and as
a plain completion otherwise, greedy, streamed, all at once. Prints one JSON object:
`{"streams": [{"i", "prompt", "chat", "text", "finish", "error", "seconds"}, ...]}`.
"""

import asyncio
import json
import sys
import time

import openai

base_url, model, streams, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = sys.argv[5:]


async def one(client, i):
    p = i % len(prompts)
    chat = i % 8 == 1
    start = time.monotonic()
    parts, finish, error = [], None, None
    try:
        if chat:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompts[p]}],
                max_tokens=max_tokens, temperature=0, stream=True)
            async for chunk in stream:
                for c in chunk.choices:
                    if c.delta.content:
                        parts.append(c.delta.content)
                    if c.finish_reason:
                        finish = c.finish_reason
        else:
            stream = await client.completions.create(
                model=model, prompt=prompts[p], max_tokens=max_tokens, temperature=0,
                stream=True)
            async for chunk in stream:
                for c in chunk.choices:
                    parts.append(c.text)
                    if c.finish_reason:
                        finish = c.finish_reason
    except openai.APIError as e:
        error = f"{type(e).__name__}: {getattr(e, 'status_code', '')} {e}"
    return {"i": i, "prompt": p, "chat": chat, "text": "".join(parts), "finish": finish,
            "error": error, "seconds": round(time.monotonic() - start, 3)}


async def main():
    # The client's pool allows far more connections than STREAMS: one each, all at once.
    client = openai.AsyncOpenAI(base_url=base_url, api_key="no-key-configured", max_retries=0,
                                timeout=300)
    results = await asyncio.gather(*(one(client, i) for i in range(streams)))
    await client.close()
    print(json.dumps({"streams": list(results)}))


asyncio.run(main())
