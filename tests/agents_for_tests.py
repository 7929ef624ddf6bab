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


async def harness_group(base_url, prompt, n, request_kwargs=None):
    """A harness that names its own conversations, as verifiers does: ``n`` rollouts at once, one
    X-Session-ID each, streamed chat; the first reports its reward with /finish, the rest are scored by
    the run's reward function, the last one's reward comes back in the returned mapping."""
    import asyncio

    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    async def one(k: int, client: httpx.AsyncClient):
        headers = {"X-Session-ID": f"trace-{k}", "Authorization": "Bearer EMPTY"}
        history = list(messages)
        for turn in range(2):
            body = {"model": "m", "messages": history, "user": "harness", **(request_kwargs or {})}
            r = await client.post(base_url + "/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()
            history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
            history += [{"role": "user", "content": f"Check step {turn}."}]
        if k == 0:
            (await client.post(base_url + "/finish", json={"reward": 0.25}, headers=headers)).raise_for_status()

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(one(k, client) for k in range(n)))
    return {f"trace-{n - 1}": 0.75}


CALCULATOR = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 6}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    }
]


async def forced_tool_call(client, sample) -> float:
    """Forces a calculator call on its first turn (tool_choice: the function, by a grammar), answers it, and
    lets the model reply freely; rewarded 1 when the call came back parsed."""
    messages = sample.messages
    choice = {"type": "function", "function": {"name": "calculator"}}
    first = await client.chat.completions.create(
        model="m", messages=messages, tools=CALCULATOR, tool_choice=choice, max_tokens=160
    )
    (call,) = first.choices[0].message.tool_calls
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": 42}'},
    ]
    await client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR, tool_choice="none")
    return float(first.choices[0].finish_reason == "tool_calls")
