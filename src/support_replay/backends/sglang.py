"""SGLang >= 0.5.20 over HTTP; also our own server and router, which speak the same ``/generate``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ..engine import GenerateRequest
from ..errors import WireError
from ..wire import from_sglang_meta_info
from .base import Completion, fan_out, optional_fields, post_json, validate_completion


def sampling_params_json(req: GenerateRequest) -> dict:
    p = req.params
    body = {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "max_new_tokens": req.max_new_tokens,
        "ignore_eos": req.ignore_eos,
        **optional_fields(req, "sampling_seed"),
    }
    return body


class SGLangBackend:
    """One ``POST /generate`` per request, sent concurrently (the engine batches them).

    One request per call keeps typed routers (sglang-router declares a single
    ``sampling_params`` object) on the path working. ``binary_mask=True`` asks our server
    for the compact wire form of the support; SGLang ignores the field and answers with
    lists, which are read just the same.
    """

    def __init__(
        self,
        url: str,
        vocab_size: int,
        *,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        binary_mask: bool = False,
        concurrency: int = 64,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.vocab_size = vocab_size
        self.binary_mask = binary_mask
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers, transport=transport)
        self.pool = ThreadPoolExecutor(concurrency)

    def body(self, req: GenerateRequest) -> dict:
        body = {
            "input_ids": list(req.input_ids),
            "sampling_params": sampling_params_json(req),
            "return_logprob": req.return_logprob,
        }
        if req.return_sampling_mask:
            body["return_sampling_mask"] = True
            if self.binary_mask:
                body["sampling_mask_format"] = "binary"
        return body

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        return fan_out(self.pool, self._one, requests)

    def _one(self, req: GenerateRequest, index: int) -> Completion:
        item = post_json(self.client, self.url + "/generate", self.body(req), index)
        if not isinstance(item, dict):
            raise WireError(f"request {index}: {self.url}/generate returned {type(item).__name__}, expected an object")
        return self._completion(item, req, index)

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
