"""The official `openai` package against openaid: tests/tests/openai.rs runs this and
checks what it prints (one JSON object) against the monolithic path of the same model.

    openai_client.py BASE_URL MODEL LONG_PROMPT_WORDS DISCONNECT_MAX_TOKENS
"""

import json
import sys

import openai

base_url, model, long_words, disconnect_max = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key="no-key-configured", max_retries=0, timeout=180)
question = [{"role": "user", "content": "Name the capital city of France."}]
out = {"openai_version": openai.__version__}

r = client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0)
out["chat"] = {
    "object": r.object,
    "text": r.choices[0].message.content,
    "role": r.choices[0].message.role,
    "finish": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
}

parts, roles, finish, usage = [], [], None, None
for chunk in client.chat.completions.create(
    model=model, messages=question, max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
out["chat_stream"] = {"parts": parts, "roles": roles, "finish": finish, "usage": usage}

prompt = "Once upon a time, in a small village,"
r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
out["completion"] = {
    "object": r.object,
    "text": r.choices[0].text,
    "finish": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
}
parts, finish = [], None
for chunk in client.completions.create(
    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
):
    for c in chunk.choices:
        parts.append(c.text)
        if c.finish_reason:
            finish = c.finish_reason
out["completion_stream"] = {"parts": parts, "finish": finish}

# Sampling with a seed: the same seed twice.
sampled = [
    client.chat.completions.create(
        model=model, messages=question, max_tokens=12, temperature=0.9, top_p=0.95, seed=11
    ).choices[0].message.content
    for _ in range(2)
]
out["sampled"] = sampled

models = client.models.list()
out["models"] = [m.id for m in models.data]

try:
    client.completions.create(
        model=model, prompt="hello " * long_words, max_tokens=4, temperature=0
    )
    out["rejected"] = {"status": 200}
except openai.APIStatusError as e:
    out["rejected"] = {"status": e.status_code, "code": e.code, "message": e.message}

try:
    client.chat.completions.create(model="no-such-model", messages=question, max_tokens=4)
    out["wrong_model"] = {"status": 200}
except openai.APIStatusError as e:
    out["wrong_model"] = {"status": e.status_code, "code": e.code}

# A client that goes away mid-stream: two chunks of a long answer, then the connection closes.
stream = client.completions.create(
    model=model, prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=disconnect_max, temperature=0,
    stream=True,
)
read = []
for chunk in stream:
    read.append(chunk.choices[0].text if chunk.choices else "")
    if len(read) == 2:
        break
stream.close()
out["disconnect"] = {"chunks_read": len(read), "text_read": "".join(read)}

print(json.dumps(out))
