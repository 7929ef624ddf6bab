"""Agents the trainer tests load by path, written the two ways users write them."""

import httpx

ATTEMPTS: dict = {}


async def miles_style(base_url, prompt, request_kwargs=None, metadata=None):
    """Miles' signature: plain HTTP to base_url + /v1/chat/completions, returns metadata."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    async with httpx.AsyncClient(timeout=60) as client:
        for k in range(2):
            r = await client.post(
                base_url + "/v1/chat/completions",
                json={"model": "default", "messages": messages, "logprobs": True, **(request_kwargs or {})},
            )
            r.raise_for_status()
            content = r.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"Again, step {k}."}]
    return {"agent": "miles_style"}


async def rewriter(client, sample) -> float:
    """Edits its own first answer before the second turn: every episode splits in two samples."""
    messages = sample.messages
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [
        {"role": "assistant", "content": "I said: " + first.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    second = await client.chat.completions.create(model="m", messages=messages)
    return float(sum(c.isdigit() for c in second.choices[0].message.content or ""))


async def flaky(client, sample) -> float:
    """Raises on the first attempt of episode 0: its group is played again."""
    if sample.index == 0 and not ATTEMPTS.get("failed"):
        ATTEMPTS["failed"] = True
        raise RuntimeError("the agent's tool server is down")
    reply = await client.chat.completions.create(model="m", messages=sample.messages)
    return float(len(reply.choices[0].message.content or ""))
