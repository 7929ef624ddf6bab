"""OpenAI response objects (chat and text completions, whole or streamed as server-sent events),
built from our completions. Shared by the engine server and the session server.

``logprobs`` carry log mu: the support-normalised log-prob of each sampled token under the
policy that sampled it; ``top_logprobs`` list at most the ids of that token's support, with
their log mu (docs/agents.md, "The OpenAI surface").
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np

from ..protocol import Completion


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_logprobs(completion: Completion, decode, top: int) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries: log mu per token, and up to ``top`` ids of its support (the
    full distribution's most likely ids for an unfiltered request)."""
    out = []
    for t, ((token, lp), (ids, values)) in enumerate(
        zip(zip(completion.output_ids, completion.log_mu.tolist()), top_ids(completion, top))
    ):
        text = decode([token])
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        for i, v in zip(ids, values):
            alt = decode([i])
            entry["top_logprobs"].append({"token": alt, "logprob": v, "bytes": list(alt.encode())})
        out.append(entry)
    return out


def top_ids(completion: Completion, top: int) -> list[tuple[list[int], list[float]]]:
    """Per token, up to ``top`` ``(ids, log-probs)``, most likely first: of the support where it was captured
    with every id's log-prob, else of the full distribution (an unfiltered request's ``top_logprobs``)."""
    n = completion.num_tokens
    if not top:
        return [([], [])] * n
    rows = completion.support_row_logprobs
    if rows is not None:
        out = []
        for t in range(n):
            ids, values = completion.support.row(t), rows[t]
            order = np.argsort(-values, kind="stable")[:top]
            out.append(([int(ids[k]) for k in order], [float(values[k]) for k in order]))
        return out
    if completion.top_logprobs is not None:
        return [(ids[:top].tolist(), values[:top].tolist()) for ids, values in completion.top_logprobs]
    return [([], [])] * n


def chat_choice(
    index: int,
    content: str,
    tool_calls: list[dict],
    finish: str,
    logprobs: list[dict] | None = None,
    meta: dict | None = None,
) -> dict:
    message = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
    }
    if meta is not None:
        choice["meta_info"] = meta
    return choice


def chat_response(
    choices: list[dict], *, model: str, prompt_tokens: int, completion_tokens: int, rid: str | None = None
) -> dict:
    return {
        "id": rid or new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chat_stream(response: dict, include_usage: bool = False):
    """The chunks of a finished chat response, as OpenAI streams them: a role delta, the
    content, the tool calls (each with its index), the finish reason, usage if asked, [DONE]."""
    head = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }
    for choice in response["choices"]:
        i, message = choice["index"], choice["message"]

        def chunk(delta, finish=None, logprobs=None):
            return _sse(
                {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
            )

        yield chunk({"role": "assistant", "content": ""})
        if message.get("content"):
            yield chunk({"content": message["content"]}, logprobs=choice.get("logprobs"))
        for k, call in enumerate(message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": k, **call}]})
        final = {
            **head,
            "choices": [{"index": i, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}],
        }
        if "meta_info" in choice:
            final["choices"][0]["meta_info"] = choice["meta_info"]
        yield _sse(final)
    if include_usage:
        yield _sse({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"


def text_choice(
    index: int, text: str, finish: str, completion: Completion | None, decode, logprobs: int | None
) -> dict:
    """One ``/v1/completions`` choice; ``logprobs`` (an integer there) as the legacy fields."""
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if logprobs is not None and completion is not None:
        tokens = [decode([t]) for t in completion.output_ids]
        entries = token_logprobs(completion, decode, logprobs)
        offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": completion.log_mu.tolist(),
            "top_logprobs": [{e["token"]: e["logprob"] for e in entry["top_logprobs"]} for entry in entries],
            "text_offset": offsets,
        }
    return choice


def text_stream(response: dict):
    head = {
        "id": response["id"],
        "object": "text_completion",
        "created": response["created"],
        "model": response["model"],
    }
    for choice in response["choices"]:
        yield _sse(
            {
                **head,
                "choices": [
                    {
                        "index": choice["index"],
                        "text": choice["text"],
                        "finish_reason": None,
                        "logprobs": choice["logprobs"],
                    }
                ],
            }
        )
        yield _sse(
            {
                **head,
                "choices": [
                    {"index": choice["index"], "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}
                ],
            }
        )
    yield "data: [DONE]\n\n"


def openai_finish(completion: Completion) -> str:
    return "length" if completion.finish_reason.get("type") == "length" else "stop"
