"""HTTP request schemas of the engine server's SGLang routes (``/generate``, weight updates);
the OpenAI bodies live with their routes (``openai_routes.py``).

Strict where silence would be wrong: unknown sampling parameters are rejected, not ignored.
Penalties and logit bias are applied (and replayed by the trainer, ``core/penalties.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.penalties import Penalties
from ..core.sampling import SamplingParams
from ..errors import RequestError, SamplingParamsError
from ..protocol import GenerateRequest
from .request_fields import check_undeclared
from .structured_outputs import sglang_grammar

MAX_BATCH = (
    4096  # prompts in one request body: checked while parsing, before anything is built (the queue bounds it further)
)
TokenIds = list[int]
TokenBatch = Annotated[list[TokenIds], Field(max_length=MAX_BATCH)]
TextBatch = Annotated[list[str], Field(max_length=MAX_BATCH)]


def bounded_batches(data: Any, fields: tuple[str, ...]) -> Any:
    """Before any field is validated: a list field longer than ``MAX_BATCH`` entries fails at once
    (validating a million entries first, and naming each one that fails, takes seconds)."""
    if isinstance(data, dict):
        for name in fields:
            value = data.get(name)
            if (
                isinstance(value, list) and len(value) > MAX_BATCH and not all(type(v) is int for v in value)
            ):  # one long prompt of ids passes
                raise ValueError(f"{name}: {len(value)} entries exceed the limit of {MAX_BATCH} prompts per request")
    return data


def check_fan_out(prompts: int, n: int, queue: int) -> None:
    """Refuse (400) a request that would become more engine requests than the queue admits, before any is built."""
    if prompts * n > queue:
        raise RequestError(
            f"prompts x n: {prompts} x {n} = {prompts * n} requests exceed the engine's queue of {queue}; send fewer "
            "at a time"
        )


def _declared_only(model: BaseModel, route: str) -> BaseModel:
    check_undeclared(model.model_extra, route)
    return model


class SamplingParamsIn(BaseModel):
    """SGLang's ``sampling_params`` object; fields it does not declare go by ``request_fields``."""

    model_config = ConfigDict(extra="allow")

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_new_tokens: int = Field(0, ge=0)
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang's: keep the matched stop string or token in the text
    json_schema: str | dict | None = None  # SGLang's structured outputs (serving/structured_outputs.py)
    regex: str | None = None
    ebnf: str | None = None
    grammar: str | None = None  # ours: an llguidance grammar as SGLangBackend forwards a session's constraint

    @model_validator(mode="after")
    def _declared_fields(self):
        return _declared_only(self, "sampling_params")

    @model_validator(mode="before")
    @classmethod
    def _seed_alias(cls, data: Any) -> Any:
        # SGLang calls it sampling_seed; accept both spellings
        if isinstance(data, dict) and "sampling_seed" in data and "seed" not in data:
            data = {k: v for k, v in data.items() if k != "sampling_seed"} | {"seed": data["sampling_seed"]}
        return data

    def n_requests(self, input_ids: list[int], n: int, *, top_logprobs: int = 0, grammar=None, **capture) -> list:
        """``n`` requests for one prompt, with seeds ``seed + i`` when a seed is given (the OpenAI routes' and
        vLLM's rule for ``n``); ``capture`` as ``to_request`` takes it."""
        out = []
        for i in range(n):
            one = self.model_copy(update={"seed": None if self.seed is None else self.seed + i})
            req = one.to_request(list(input_ids), **capture)
            req.top_logprobs = top_logprobs
            if grammar is not None:
                req.grammar = grammar
            out.append(req)
        return out

    def to_request(
        self,
        input_ids: list[int],
        *,
        return_sampling_mask: bool,
        return_logprob: bool,
        sampling_logprobs_mode: str,
        rid: str | None = None,
    ) -> GenerateRequest:
        if self.n != 1:
            raise RequestError(f"sampling_params.n={self.n!r} is not supported (only 1)")
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"sampling_params.min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )
        try:
            penalties = Penalties.with_bias(
                self.frequency_penalty, self.presence_penalty, self.repetition_penalty, self.logit_bias
            )
        except SamplingParamsError as exc:
            raise RequestError(f"sampling_params.{exc}") from exc
        try:
            params = SamplingParams(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed
            )
        except SamplingParamsError as exc:
            raise RequestError(f"sampling_params.{exc}") from exc
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerateRequest(
            input_ids=input_ids,
            params=params,
            max_new_tokens=self.max_new_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.no_stop_trim,
            grammar=sglang_grammar(self.json_schema, self.regex, self.ebnf, self.grammar),
            return_sampling_mask=return_sampling_mask,
            return_logprob=return_logprob,
            sampling_logprobs_mode=sampling_logprobs_mode,
            rid=rid,
            penalties=penalties,
        )


class GenerateIn(BaseModel):
    """SGLang ``/generate``: one prompt or a batch, as text or token ids."""

    model_config = ConfigDict(extra="allow")  # SGLang's other fields go by request_fields: no-op or refused

    rid: str | Annotated[list[str], Field(max_length=MAX_BATCH)] | None = (
        None  # idempotency key(s): a repeated id gets the first answer
    )
    text: str | TextBatch | None = None
    input_ids: TokenIds | TokenBatch | None = None
    sampling_params: SamplingParamsIn | Annotated[list[SamplingParamsIn], Field(max_length=MAX_BATCH)] | None = None
    return_logprob: bool | Annotated[list[bool], Field(max_length=MAX_BATCH)] = False
    return_sampling_mask: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    sampling_mask_format: Literal["lists", "binary"] = "lists"
    return_routed_experts: bool = False  # SGLang's: meta_info["routed_experts"], every fed position's experts
    routed_experts_start_len: int = Field(0, ge=0)  # SGLang's: positions [start, prompt + output - 1)
    routed_experts_format: Literal["sglang", "npy"] = "sglang"  # ours: npy is vLLM's compact .npy form
    # SGLang's: the loaded LoRA adapter (its name or path) each prompt runs with (engine/lora_adapter.py)
    lora_path: str | Annotated[list[str | None], Field(max_length=MAX_BATCH)] | None = None
    logprob_start_len: int | list[int] = -1
    stream: bool = False  # SGLang's: one SSE chunk per token (the ids and text so far), then the whole answer

    @model_validator(mode="after")
    def _declared_fields(self):
        return _declared_only(self, "/generate")

    @model_validator(mode="after")
    def _one_prompt_streams(self):
        if self.stream and self.batched:
            raise ValueError("stream: a streamed /generate takes one prompt (send the batch's prompts apart)")
        return self

    _bounded = model_validator(mode="before")(
        classmethod(
            lambda cls, data: bounded_batches(
                data,
                ("text", "input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len", "lora_path"),
            )
        )
    )

    @field_validator("logprob_start_len")
    @classmethod
    def _no_prompt_logprobs(cls, value):
        # prompt log-probs would be a recomputation over the prefill: not what sampled the data
        if any(v != -1 for v in (value if isinstance(value, list) else [value])):
            raise ValueError(f"prompt log-probs are not supported (only -1, output tokens only), got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    def to_requests(self, tokenize, max_queue: int) -> list[GenerateRequest]:
        """One request per prompt, each per-prompt field broadcast as SGLang does (a single value for
        every prompt; one ``rid`` over a batch becomes ``rid-0``, ``rid-1``, ...)."""
        prompts = self.text if self.text is not None else self.input_ids
        prompts = prompts if self.batched else [prompts]
        check_fan_out(len(prompts), 1, max_queue)
        prompts = [tokenize(p) if isinstance(p, str) else p for p in prompts]
        n = len(prompts)
        sp = self.sampling_params if self.sampling_params is not None else SamplingParamsIn()
        sps = sp if isinstance(sp, list) else [sp] * n
        rl = self.return_logprob if isinstance(self.return_logprob, list) else [self.return_logprob] * n
        if len(sps) != n or len(rl) != n:
            raise RequestError(f"sampling_params / return_logprob: {len(sps)} / {len(rl)} entries for {n} prompts")
        rids = self.rid if isinstance(self.rid, list) else [self.rid] * n
        if len(rids) != n or (self.rid is not None and not self.batched and isinstance(self.rid, list)):
            raise RequestError(f"rid: {len(rids)} ids for {n} prompts")
        if self.batched and isinstance(self.rid, str):
            rids = [f"{self.rid}-{i}" for i in range(n)]  # SGLang's rule for one id over a batch
        fields = dict(
            return_sampling_mask=self.return_sampling_mask, sampling_logprobs_mode=self.sampling_logprobs_mode
        )
        out = [s.to_request(p, return_logprob=r, rid=i, **fields) for p, s, r, i in zip(prompts, sps, rl, rids)]
        loras = self.lora_path if isinstance(self.lora_path, list) else [self.lora_path] * n
        if len(loras) != n:
            raise RequestError(f"lora_path: {len(loras)} entries for {n} prompts")
        for i, (req, lora) in enumerate(zip(out, loras)):
            req.lora_path = lora
            req.return_routed_experts = self.return_routed_experts
            if self.routed_experts_start_len > len(req.input_ids):  # SGLang's rule (managers/scheduler.py)
                raise RequestError(
                    f"routed_experts_start_len: {self.routed_experts_start_len} is past the "
                    f"{len(req.input_ids)} input tokens of prompt {i}"
                )
        return out

    @property
    def batched(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class LoadLoRAAdapterIn(BaseModel):
    """SGLang's ``/load_lora_adapter`` body (``LoadLoRAAdapterReqInput``): a peft adapter directory under a name."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False  # SGLang's: kept in its adapter memory pool; ours holds the one adapter merged anyway


class UnloadLoRAAdapterIn(BaseModel):
    """SGLang's ``/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)


class PauseGenerationIn(BaseModel):
    """SGLang's ``/pause_generation`` body (``PauseGenerationReqInput``; engine/pausing.py says what each mode does)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequestIn(BaseModel):
    """SGLang's ``/abort_request`` body (``AbortReq``): one request by its ``rid``, or every one."""

    model_config = ConfigDict(extra="forbid")

    rid: str = Field("", max_length=256)
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_or_all(self):
        if not self.rid and not self.abort_all:
            raise RequestError("abort_request: give a rid, or abort_all: true")
        return self


class ContinueGenerationIn(BaseModel):
    """SGLang's ``/continue_generation`` body (``ContinueGenerationReqInput``)."""

    model_config = ConfigDict(extra="forbid")

    torch_empty_cache: bool = True  # SGLang's: returns CUDA's cached blocks first; a CPU engine has none


class UpdateWeightVersionIn(BaseModel):
    """SGLang's ``update_weight_version`` body."""

    model_config = ConfigDict(extra="allow")

    new_version: str = Field(min_length=1, max_length=256)


class UpdateWeightsIn(BaseModel):
    """SGLang's ``update_weights_from_disk`` body; ``weight_version`` names the new weights."""

    model_config = ConfigDict(extra="allow")

    model_path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")  # a NUL byte is no path
    weight_version: str | None = Field(None, max_length=256)
    abort_all_requests: bool = False  # SGLang's: abort what runs instead of letting it finish on the old weights
