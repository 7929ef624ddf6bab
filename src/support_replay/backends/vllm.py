"""vLLM over HTTP (``/v1/completions`` with prompt token ids).

Two ways to get the support (docs/engines.md):

- ``mode="native"``: servers with ``--return-sampling-mask`` (Model Runner V2) return
  ``choices[].sampling_mask``; log mu is the processed log-prob of the sampled token.
- ``mode="processed_logprobs"``: servers started with
  ``--logprobs-mode processed_logprobs`` return log-probs after temperature, min-p, top-k
  and top-p, renormalised over the support and -inf (sent as -9999.0) outside it. Asking
  ``logprobs = top_k + 1`` reveals the support as the finite entries; a token whose
  entries are all finite may have a larger support (top-k keeps ties) and fails closed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ..errors import SupportError, WireError
from ..protocol import Completion, GenerateRequest, validate_completion
from ..support import SupportTable
from .base import fan_out, optional_fields, post_json

_TOKEN_PREFIX = "token_id:"
_NEG_INF = -9999.0  # how vLLM serialises -inf over HTTP


def _table(rows: list[list[int]], field: str) -> SupportTable:
    try:
        return SupportTable.from_lists(rows)
    except SupportError as exc:
        raise WireError(f"{field}: {exc}") from exc


def parse_native_mask(output_ids: list[int], sampling_mask, sampled_logprobs) -> tuple[SupportTable, np.ndarray]:
    """``(support, log mu)`` from a native ``sampling_mask`` (one id list per output token,
    or ``{"token_ids": [...]}`` per token) and the processed log-probs of the sampled tokens."""
    if not isinstance(sampling_mask, list):
        raise WireError(f"sampling_mask: expected one id list per token, got {type(sampling_mask).__name__}")
    rows = []
    for t, row in enumerate(sampling_mask):
        row = row.get("token_ids") if isinstance(row, dict) else row
        if not isinstance(row, list) or not row or not all(isinstance(i, int) and not isinstance(i, bool) for i in row):
            raise WireError(f"sampling_mask[{t}]: expected a non-empty list of integer token ids, got {row!r:.80}")
        rows.append(row)
    if len(rows) != len(output_ids):
        raise WireError(f"sampling_mask: {len(rows)} support rows for {len(output_ids)} output tokens")
    if sampled_logprobs is None or len(sampled_logprobs) != len(output_ids):
        n = "none" if sampled_logprobs is None else len(sampled_logprobs)
        raise WireError(f"logprobs: {n} processed log-probs for {len(output_ids)} output tokens")
    return _table(rows, "sampling_mask"), np.asarray(sampled_logprobs, np.float32)


def parse_processed_logprobs(output_ids: list[int], top_logprobs, requested: int) -> tuple[SupportTable, np.ndarray]:
    """``(support, log mu)`` from ``processed_logprobs``: per token a mapping id -> log-prob
    where the finite entries are the support (-inf arrives as -9999.0). When all ``requested``
    entries of a token are finite the support may be larger than what came back: fail closed."""
    if not top_logprobs:
        raise WireError(
            "the response carries no processed top_logprobs: ask logprobs=K with a server started with "
            "--logprobs-mode processed_logprobs, or use a server with --return-sampling-mask"
        )
    if not isinstance(top_logprobs, list) or len(top_logprobs) != len(output_ids):
        n = len(top_logprobs) if isinstance(top_logprobs, list) else type(top_logprobs).__name__
        raise WireError(f"top_logprobs: {n} entries for {len(output_ids)} output tokens")
    rows, picked = [], []
    for t, (entries, tok) in enumerate(zip(top_logprobs, output_ids)):
        if not isinstance(entries, dict):
            raise WireError(f"top_logprobs[{t}]: expected a mapping token id -> log-prob")
        finite = {int(i): float(v) for i, v in entries.items() if v is not None and float(v) > _NEG_INF / 2}
        if requested > 0 and len(finite) >= requested:
            raise WireError(
                f"top_logprobs[{t}]: all {requested} returned entries are finite, so the support may be "
                "larger than what was returned; raise logprobs to at least the top_k of the request"
            )
        if tok not in finite:
            raise WireError(f"top_logprobs[{t}]: selected token {tok} has no finite processed log-prob")
        rows.append(sorted(finite))
        picked.append(finite[tok])
    return _table(rows, "top_logprobs"), np.asarray(picked, np.float32)


def _token_id(text: str, where: str) -> int:
    if not isinstance(text, str) or not text.startswith(_TOKEN_PREFIX):
        raise WireError(f"{where}: token {text!r} is not in 'token_id:N' form; send return_tokens_as_token_ids=true")
    return int(text[len(_TOKEN_PREFIX) :])


class VLLMBackend:
    def __init__(
        self,
        url: str,
        model: str,
        vocab_size: int,
        *,
        mode: str = "processed_logprobs",
        max_logprobs: int = 20,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        concurrency: int = 64,
        transport: httpx.BaseTransport | None = None,
    ):
        if mode not in ("native", "processed_logprobs"):
            raise ValueError(f"mode: 'native' or 'processed_logprobs', got {mode!r}")
        self.url, self.model, self.vocab_size, self.mode = url.rstrip("/"), model, vocab_size, mode
        self.max_logprobs = max_logprobs
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers, transport=transport)
        self.pool = ThreadPoolExecutor(concurrency)

    def requested_logprobs(self, req: GenerateRequest) -> int:
        k = req.params.top_k
        return k + 1 if k > 0 else self.max_logprobs

    def body(self, req: GenerateRequest) -> dict:
        p = req.params
        body = {
            "model": self.model,
            "prompt": list(req.input_ids),
            "max_tokens": req.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "ignore_eos": req.ignore_eos,
            "return_tokens_as_token_ids": True,
            "logprobs": 0,
            **optional_fields(req, "seed"),
        }
        if req.return_sampling_mask:
            if self.mode == "native":
                body["return_sampling_mask"] = True
            else:
                body["logprobs"] = self.requested_logprobs(req)
        return body

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        for i, req in enumerate(requests):
            if req.return_logprob:
                raise WireError(
                    f"request {i}: full-vocabulary log-probs are not available from a vLLM server that returns processed "
                    "log-probs; score them in the trainer"
                )
        return fan_out(self.pool, self._one, requests)

    def _one(self, req: GenerateRequest, index: int) -> Completion:
        answer, _ = post_json(self.client, self.url + "/v1/completions", self.body(req), index)
        return validate_completion(self.parse_choice(answer["choices"][0], req, index), req, self.vocab_size, index)

    def parse_choice(self, choice: dict, req: GenerateRequest, index: int = 0) -> Completion:
        """The ``Completion`` of one ``/v1/completions`` choice (not yet validated)."""
        where = f"completion {index}"
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens")
        if not tokens:
            raise WireError(f"{where}: no token ids in the response (logprobs.tokens); the request must ask logprobs")
        output_ids = [_token_id(t, where) for t in tokens]
        support = log_mu = None
        if req.return_sampling_mask:
            try:
                if self.mode == "native":
                    if choice.get("sampling_mask") is None:
                        raise WireError(
                            "no sampling_mask in the response: the server needs --return-sampling-mask "
                            "(Model Runner V2), or a proxy on the path stripped return_sampling_mask"
                        )
                    support, log_mu = parse_native_mask(output_ids, choice["sampling_mask"], lp.get("token_logprobs"))
                else:
                    top = [{_token_id(k, where): v for k, v in (entry or {}).items()} for entry in lp.get("top_logprobs") or []]
                    support, log_mu = parse_processed_logprobs(output_ids, top, self.requested_logprobs(req))
            except WireError as exc:
                raise WireError(f"{where}: {exc}") from exc
            sampled = np.asarray(lp.get("token_logprobs") or [], np.float64)
            if len(sampled) == len(output_ids) and not np.allclose(sampled, log_mu, atol=1e-5):
                t = int(np.argmax(np.abs(sampled - log_mu)))
                raise WireError(f"{where} token {t}: sampled log-prob {sampled[t]} disagrees with its support entry {log_mu[t]}")
        finish = choice.get("finish_reason")
        return Completion(
            output_ids=output_ids,
            finish_reason={"type": finish} if isinstance(finish, str) else (finish or {}),
            log_mu=log_mu,
            support=support,
            text=choice.get("text") or "",
        )
