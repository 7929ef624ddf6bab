"""What every HTTP backend shares: the client interface, optional request fields, the POST with
its retries, and the concurrent fan-out. The record they return and its validation live in
``protocol.py``.

A request is retried, with the same body (the same ``rid`` and seed, so an engine that already
has it answers once), when the engine cannot be reached, takes longer than the timeout, or
answers 502/503/504 (``Retry-After`` respected); after the last try it is ``EngineUnavailable``.
A 4xx is the request's own fault and fails closed at once.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import httpx

from ..errors import AbortedError, EngineOverloaded, EngineUnavailable, WireError
from ..protocol import SESSION_HEADER, GenerateRequest, sampling_fields

RETRIES = 3  # tries after the first
RETRY_STATUSES = (502, 503, 504)
ABORTED_STATUS = AbortedError.status  # our serve's answer for a request a weight update aborted before it ran
MAX_BACKOFF = 10.0


class Backend(Protocol):
    vocab_size: int
    retries: int  # requests sent again so far

    def generate(self, requests: list[GenerateRequest], *, return_exceptions: bool = False) -> list: ...


class RetryCounter:
    """How many requests were sent again, for the metrics (thread-safe)."""

    def __init__(self):
        self._lock, self.value = threading.Lock(), 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


def sampling_settings(req: GenerateRequest) -> dict:
    """The sampling settings and penalties a request sends: every one explicitly (a server fills omitted ones
    from the model's generation_config.json), the logit bias when it has one; only its
    ``sent_sampling_fields`` where it names them (the audit, acting as a user's client)."""
    out = {k: v for k, v in sampling_fields(req).items() if k != "logit_bias" or v}
    if req.sent_sampling_fields is None:
        return out
    return {k: v for k, v in out.items() if k in req.sent_sampling_fields}


# the output-shaping settings under each engine's names, sent only where a request leaves their defaults
OUTPUT_FIELD_NAMES = {
    "sglang": {"min_new_tokens": "min_new_tokens", "include_stop_str_in_output": "no_stop_trim"},
    "vllm": {"min_new_tokens": "min_tokens", "include_stop_str_in_output": "include_stop_str_in_output"},
}
OUTPUT_DEFAULTS = {
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
}


def optional_fields(req: GenerateRequest, seed_key: str, engine: str = "sglang") -> dict:
    """Seed, stop conditions and output settings of a request, only where it sets them (engines name some of
    them differently)."""
    names = OUTPUT_FIELD_NAMES[engine]
    out = {names.get(k, k): getattr(req, k) for k, default in OUTPUT_DEFAULTS.items() if getattr(req, k) != default}
    if req.params.seed is not None:
        out[seed_key] = req.params.seed
    if req.stop:
        out["stop"] = list(req.stop)
    if req.stop_token_ids:
        out["stop_token_ids"] = list(req.stop_token_ids)
    return out


def session_headers(req: GenerateRequest) -> dict:
    """The routing header of a session's turn (none for a single-turn request)."""
    return {SESSION_HEADER: req.routing_key} if req.routing_key else {}


def post_json(
    client,
    url: str,
    body: dict,
    index: int,
    retries: RetryCounter | None = None,
    tries: int = RETRIES + 1,
    headers: dict | None = None,
):
    """POST ``body``; ``(decoded JSON answer, body size in bytes)``. ``WireError`` naming the request
    and the status for a refusal, ``EngineUnavailable`` when no try got an answer."""
    problem, overloaded = "", 0  # tries answered 503: the engine's queue was full, nothing of the request ran
    for attempt in range(tries):
        if attempt and retries is not None:
            retries.add()
        try:
            reply = client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:  # refused, dropped, or past the timeout
            problem = f"{type(exc).__name__}: {exc}"
            time.sleep(min(MAX_BACKOFF, 0.5 * 2**attempt))
            continue
        if reply.status_code in RETRY_STATUSES:
            problem = f"HTTP {reply.status_code}: {reply.text[:300]}"
            overloaded += reply.status_code == 503
            wait = reply.headers.get("retry-after", "")
            time.sleep(min(MAX_BACKOFF, float(wait) if wait.replace(".", "", 1).isdigit() else 0.5 * 2**attempt))
            continue
        if reply.status_code == ABORTED_STATUS:  # a weight update (abort mode) or a cancel: no answer, like a drop
            raise EngineUnavailable(f"request {index}: {url} aborted it (HTTP {ABORTED_STATUS}: {reply.text[:300]})")
        if reply.status_code != 200:
            raise WireError(f"request {index}: {url} answered HTTP {reply.status_code}: {reply.text[:500]}")
        try:
            return reply.json(), len(reply.content)
        except ValueError as exc:
            raise WireError(f"request {index}: {url} answered with a body that is not JSON: {exc}") from exc
    kind = EngineOverloaded if overloaded == tries else EngineUnavailable
    raise kind(f"request {index}: {url} gave no answer in {tries} tries ({problem})")


def fan_out(pool, fn, requests, return_exceptions: bool = False) -> list:
    """``fn(request, index)`` for every request, concurrently; results in request order. With
    ``return_exceptions`` a request that failed with ``EngineUnavailable`` has it in its place."""
    futures = [pool.submit(fn, req, i) for i, req in enumerate(requests)]
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except EngineUnavailable as exc:
            if not return_exceptions:
                raise
            out.append(exc)
    return out


def get_info(url: str, path: str, headers: dict | None = None) -> dict:
    """The JSON object an engine answers at ``path`` ({} where it has no such route); ``EngineUnavailable``
    when it gives no usable answer."""
    try:
        reply = httpx.get(url.rstrip("/") + path, timeout=30, headers=headers or {})
        info = reply.json() if reply.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as exc:
        raise EngineUnavailable(f"--rollout-url {url}: no usable answer at {path} ({exc})") from exc
    return info if isinstance(info, dict) else {}
