"""What every HTTP backend shares: the client interface, optional request fields, the POST and
the concurrent fan-out. The record they return and its validation live in ``protocol.py``."""

from __future__ import annotations

from typing import Protocol

from ..errors import WireError
from ..protocol import Completion, GenerateRequest


class Backend(Protocol):
    vocab_size: int

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]: ...


def optional_fields(req: GenerateRequest, seed_key: str) -> dict:
    """Seed and stop conditions of a request, only where it sets them (engines name the seed differently)."""
    out = {}
    if req.params.seed is not None:
        out[seed_key] = req.params.seed
    if req.stop:
        out["stop"] = list(req.stop)
    if req.stop_token_ids:
        out["stop_token_ids"] = list(req.stop_token_ids)
    return out


def post_json(client, url: str, body: dict, index: int):
    """POST ``body``; ``(decoded JSON answer, body size in bytes)``, or ``WireError`` naming the request and the status."""
    reply = client.post(url, json=body)
    if reply.status_code != 200:
        raise WireError(f"request {index}: {url} answered HTTP {reply.status_code}: {reply.text[:500]}")
    try:
        return reply.json(), len(reply.content)
    except ValueError as exc:
        raise WireError(f"request {index}: {url} answered with a body that is not JSON: {exc}") from exc


def fan_out(pool, fn, requests) -> list:
    """``fn(request, index)`` for every request, concurrently; results in request order."""
    futures = [pool.submit(fn, req, i) for i, req in enumerate(requests)]
    return [f.result() for f in futures]
