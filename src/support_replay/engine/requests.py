"""What goes into the engine and what comes out of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SupportReplayError
from ..sampling import SamplingParams
from ..support import SupportTable


class EngineError(SupportReplayError):
    """A request the engine cannot serve; ``status`` is the HTTP status it maps to."""

    status = 500


class RequestError(EngineError):
    """Malformed or unsupported request (HTTP 400)."""

    status = 400


class CapacityError(RequestError):
    """The realized support exceeded ``sampling_mask_max_tokens`` (HTTP 400, nothing committed)."""


@dataclass
class GenerateRequest:
    """One prompt to complete. ``input_ids`` are already tokenized."""

    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    return_sampling_mask: bool = False
    return_logprob: bool = False
    support_logprobs: bool = False  # also log mu of every id of S_t ("support" mode)

    def __post_init__(self):
        if not self.input_ids:
            raise RequestError("input_ids: the prompt is empty")
        bad = next((t for t in self.input_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
        if bad is not None:
            raise RequestError(f"input_ids: {bad!r} is not a token id")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass
class GenerationResult:
    """The completion of one request, with the replay metadata when it was asked for."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict
    logprobs: list[float] | None = None  # log mu per token (support-normalised)
    support: SupportTable | None = None  # S_t per token
    full_logprobs: list[float] | None = None  # log softmax(z/T)[a_t], when return_logprob
    support_logprob_rows: list[list[float]] | None = None  # per token, aligned with the support row
    weight_version: int = 0
    text: str = ""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass
class _Sequence:
    """Engine-side state of one running request."""

    request: GenerateRequest
    future: object  # concurrent.futures.Future
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    supports: list = field(default_factory=list)  # one canonical id array per token
    full_logprobs: list[float] = field(default_factory=list)
    support_logprob_rows: list[list[float]] = field(default_factory=list)
    position: int = 0  # position id of the next token fed to the model
    finish_reason: dict | None = None
    text: str = ""
