"""The completion every backend returns, and the checks it must pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..engine.requests import GenerateRequest
from ..errors import SupportError, WireError
from ..support import SupportTable


@dataclass
class Completion:
    """One generated response, with its replay metadata when capture was asked for."""

    output_ids: list[int]
    logprobs: np.ndarray | None  # log mu per token, float32
    support: SupportTable | None
    full_logprobs: np.ndarray | None
    finish_reason: dict
    text: str = ""
    weight_version: int | None = None
    meta: dict = field(default_factory=dict)


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
    """POST ``body``; the decoded JSON answer, or ``WireError`` naming the request and the status."""
    reply = client.post(url, json=body)
    if reply.status_code != 200:
        raise WireError(f"request {index}: {url} answered HTTP {reply.status_code}: {reply.text[:500]}")
    return reply.json()


def fan_out(pool, fn, requests) -> list:
    """``fn(request, index)`` for every request, concurrently; results in request order."""
    futures = [pool.submit(fn, req, i) for i, req in enumerate(requests)]
    return [f.result() for f in futures]


class Backend(Protocol):
    vocab_size: int

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]: ...


def validate_completion(completion: Completion, request: GenerateRequest, vocab_size: int, index: int = 0) -> Completion:
    """SPEC section 3 on one response: raise ``WireError`` naming the sample and the rule."""
    where = f"completion {index}"
    n = len(completion.output_ids)
    if n == 0:
        raise WireError(f"{where}: empty response")
    bad = [t for t in completion.output_ids if not 0 <= t < vocab_size]
    if bad:
        raise WireError(f"{where}: output token {bad[0]} outside the vocabulary [0, {vocab_size})")
    if request.return_sampling_mask:
        if completion.support is None or completion.logprobs is None:
            raise WireError(f"{where}: capture was requested but the response carries no support")
        if completion.support.num_rows != n or len(completion.logprobs) != n:
            raise WireError(f"{where}: {completion.support.num_rows} support rows and {len(completion.logprobs)} log-probs for {n} tokens")
        try:
            completion.support.validate(vocab_size, completion.output_ids, name=where)
        except SupportError as exc:
            raise WireError(str(exc)) from exc
        lp = np.asarray(completion.logprobs, dtype=np.float64)
        if not np.all(np.isfinite(lp)):
            t = int(np.flatnonzero(~np.isfinite(lp))[0])
            raise WireError(f"{where} token {t}: log mu {lp[t]} is not finite")
        singleton = completion.support.sizes() == 1
        if np.any(np.abs(lp[singleton]) > 1e-6):
            t = int(np.flatnonzero(singleton & (np.abs(lp) > 1e-6))[0])
            raise WireError(f"{where} token {t}: singleton support but log mu {lp[t]} != 0")
    if request.return_logprob and (completion.full_logprobs is None or len(completion.full_logprobs) != n):
        raise WireError(f"{where}: full-vocabulary log-probs were requested but not returned for every token")
    return completion
