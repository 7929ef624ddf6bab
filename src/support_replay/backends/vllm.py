"""vLLM over HTTP (``/v1/completions`` with prompt token ids).

Two ways to get the support (SPEC section 6):

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

from ..engine import GenerateRequest
from ..errors import WireError
from ..wire import from_vllm
from .base import Completion, fan_out, optional_fields, post_json, validate_completion

_TOKEN_PREFIX = "token_id:"


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
        answer = post_json(self.client, self.url + "/v1/completions", self.body(req), index)
        return self.parse_choice(answer["choices"][0], req, index)

    def parse_choice(self, choice: dict, req: GenerateRequest, index: int = 0) -> Completion:
        where = f"completion {index}"
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens")
        if not tokens:
            raise WireError(f"{where}: no token ids in the response (logprobs.tokens); the request must ask logprobs")
        output_ids = [_token_id(t, where) for t in tokens]
        support = logprobs = None
        if req.return_sampling_mask:
            try:
                if self.mode == "native":
                    if choice.get("sampling_mask") is None:
                        raise WireError(
                            "no sampling_mask in the response: the server needs --return-sampling-mask "
                            "(Model Runner V2), or a proxy on the path stripped return_sampling_mask"
                        )
                    support, logprobs = from_vllm(
                        output_ids, sampling_mask=choice["sampling_mask"], sampled_logprobs=lp.get("token_logprobs"), vocab_size=self.vocab_size
                    )
                else:
                    top = [{_token_id(k, where): v for k, v in (entry or {}).items()} for entry in lp.get("top_logprobs") or []]
                    support, logprobs = from_vllm(
                        output_ids, top_logprobs=top, requested_logprobs=self.requested_logprobs(req), vocab_size=self.vocab_size
                    )
            except WireError as exc:
                raise WireError(f"{where}: {exc}") from exc
            sampled = np.asarray(lp.get("token_logprobs") or [], np.float64)
            if len(sampled) == len(output_ids) and not np.allclose(sampled, logprobs, atol=1e-5):
                t = int(np.argmax(np.abs(sampled - logprobs)))
                raise WireError(f"{where} token {t}: sampled log-prob {sampled[t]} disagrees with its support entry {logprobs[t]}")
        finish = choice.get("finish_reason")
        completion = Completion(
            output_ids=output_ids,
            logprobs=logprobs,
            support=support,
            full_logprobs=None,
            finish_reason={"type": finish} if isinstance(finish, str) else (finish or {}),
            text=choice.get("text", ""),
            meta={"stop_reason": choice.get("stop_reason")},
        )
        return validate_completion(completion, req, self.vocab_size, index)
