"""SGLang >= 0.5.20 over HTTP; also our own server and router, which speak the same ``/generate``."""

from __future__ import annotations

import httpx
import numpy as np

from ..engine import GenerateRequest
from ..errors import WireError
from ..wire import from_sglang_meta_info
from .base import Completion, validate_completion


def sampling_params_json(req: GenerateRequest) -> dict:
    p = req.params
    body = {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "max_new_tokens": req.max_new_tokens,
        "ignore_eos": req.ignore_eos,
    }
    if p.seed is not None:
        body["sampling_seed"] = p.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.stop_token_ids:
        body["stop_token_ids"] = list(req.stop_token_ids)
    return body


class SGLangBackend:
    """``POST /generate`` with the whole batch in one request.

    ``binary_mask=True`` asks our server for the compact wire form of the support; SGLang
    itself ignores the field and answers with lists, which are read just the same.
    """

    def __init__(
        self,
        url: str,
        vocab_size: int,
        *,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        binary_mask: bool = False,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.vocab_size = vocab_size
        self.binary_mask = binary_mask
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers, transport=transport)

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        if not requests:
            return []
        capture = {r.return_sampling_mask for r in requests}
        if len(capture) != 1:
            # return_sampling_mask is one flag per /generate call: split mixed batches
            mixed = [None] * len(requests)
            for flag in (True, False):
                idx = [i for i, r in enumerate(requests) if r.return_sampling_mask == flag]
                for i, c in zip(idx, self.generate([requests[i] for i in idx])):
                    mixed[i] = c
            return mixed
        body = {
            "input_ids": [list(r.input_ids) for r in requests],
            "sampling_params": [sampling_params_json(r) for r in requests],
            "return_logprob": [r.return_logprob for r in requests],
        }
        if requests[0].return_sampling_mask:
            body["return_sampling_mask"] = True
            if self.binary_mask:
                body["sampling_mask_format"] = "binary"
        reply = self.client.post(self.url + "/generate", json=body)
        if reply.status_code != 200:
            raise WireError(f"{self.url}/generate answered HTTP {reply.status_code}: {reply.text[:500]}")
        items = reply.json()
        if not isinstance(items, list) or len(items) != len(requests):
            raise WireError(f"{self.url}/generate: expected {len(requests)} results, got {type(items).__name__}")
        return [self._completion(item, req, i) for i, (item, req) in enumerate(zip(items, requests))]

    def _completion(self, item: dict, req: GenerateRequest, index: int) -> Completion:
        try:
            output_ids = [int(t) for t in item["output_ids"]]
            meta = item["meta_info"]
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"completion {index}: malformed /generate result ({exc})") from exc
        support = logprobs = full = None
        if req.return_sampling_mask:
            try:
                support, logprobs = from_sglang_meta_info(meta, output_ids, self.vocab_size)
            except WireError as exc:
                raise WireError(f"completion {index}: {exc}") from exc
        if req.return_logprob:
            entries = meta.get("output_token_logprobs") or []
            full = np.asarray([e[0] for e in entries], np.float32)
        completion = Completion(
            output_ids=output_ids,
            logprobs=logprobs,
            support=support,
            full_logprobs=full,
            finish_reason=meta.get("finish_reason") or {},
            text=item.get("text", ""),
            weight_version=meta.get("weight_version"),
            meta=meta,
        )
        return validate_completion(completion, req, self.vocab_size, index)
