"""One running request's state in the engine: what it has produced so far, and its answer."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.support import SupportTable
from ..protocol import Completion, GenerateRequest, VersionSpan, sampler_record
from .row_step import RowStep
from .stopping import output_text


@dataclass
class RunningRequest:
    """Engine-side state of one running request."""

    request: GenerateRequest
    future: Future
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    log_mu: list[float] = field(default_factory=list)
    supports: list[np.ndarray] = field(default_factory=list)  # one canonical id array per token
    full_logprobs: list[float] = field(default_factory=list)
    support_row_logprobs: list[np.ndarray] = field(default_factory=list)
    top_logprobs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    position: int = 0  # position id of the next token fed to the model
    finish_reason: dict | None = None
    text: str = ""
    decoded: str = ""  # the output's text so far, decoded incrementally (stop strings)
    decode_from: tuple[int, int] = (0, 0)  # (prefix, read) token offsets of the incremental decode
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # the request's logit bias as a row, built at admission
    failure: tuple[Exception, str] | None = None  # why it stopped early, answered once its row has left the batch
    routing: list[np.ndarray] = field(
        default_factory=list
    )  # [n, layers, top_k] chunks: the prompt, then each fed token
    # earlier computations' routing of a prefix a retract's recompute routed again: [prompt + n - 1, ...] each,
    # for the outputs sampled before it (Completion.routed_experts_history: every one, so that each switch of
    # weights inside an answer shows its recompute; the sample keeps those that routed otherwise)
    routing_history: list[np.ndarray] = field(default_factory=list)
    grammar: object = None  # the request's llguidance matcher (structured outputs), built at admission
    need: int = 0  # cache columns reserved: prompt + max_new_tokens + the write column (engine/kv_budget.py)
    captured: int = 0  # support ids captured so far (EngineLimits.max_capture_ids_running)
    epoch: int = 0  # the weights it was admitted under (PrefixCache.epoch): its keys and values are theirs
    versions: list[tuple[str, int]] = field(default_factory=list)  # (old version, outputs it had sampled) per switch

    def fed_ids(self) -> list[int]:
        """The prompt and every output so far: what a prefill of this row computes (a retracted row's recompute)."""
        return [*self.request.input_ids, *self.output_ids]

    def new_version(self, old: str) -> None:
        """The weights changed under this row (a paused engine's update): its outputs so far were ``old``'s."""
        if self.output_ids:
            self.versions.append((old, len(self.output_ids)))

    def version_spans(self, current: str) -> list[VersionSpan]:
        """Which weights sampled which outputs (SGLang's ``compute_weight_version_spans``)."""
        spans: list[VersionSpan] = []
        for version, end in [*self.versions, (current, len(self.output_ids))]:
            start = spans[-1].end if spans else 0
            if end <= start:
                continue
            if spans and spans[-1].version == version:
                spans[-1] = VersionSpan(version, spans[-1].start, end)
            else:
                spans.append(VersionSpan(str(version), start, end))
        return spans or [VersionSpan(str(current), 0, 0)]

    def record(self, step: RowStep) -> None:
        """Keep what one step sampled and captured for this request."""
        if step.support is not None:
            self.supports.append(step.support)
            self.captured += len(step.support)
            self.log_mu.append(step.log_mu)
            if step.support_row_logprobs is not None:
                self.support_row_logprobs.append(step.support_row_logprobs)
        if step.full_logprob is not None:
            self.full_logprobs.append(step.full_logprob)
        if step.top is not None:
            self.top_logprobs.append(step.top)
        self.output_ids.append(step.token)

    def fail(self, error: Exception, where: str) -> None:
        """Stop this request early; it is answered with ``error`` once its row has left the batch."""
        self.finish_reason, self.failure = {"type": "abort"}, (error, where)

    def completion(self, tokenizer, weight_version: str, semantics: str, version: str) -> Completion:
        """The answer; a captured one carries the sampler record (what this engine sampled it with)."""
        req = self.request
        matched_string = self.finish_reason.get("type") == "stop" and isinstance(self.finish_reason.get("matched"), str)
        text = self.text if matched_string else output_text(tokenizer, self.output_ids, req, self.finish_reason)
        capture = req.return_sampling_mask
        routed = np.concatenate(self.routing) if req.return_routed_experts else None
        support_mode = capture and req.sampling_logprobs_mode == "support"
        return Completion(
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            log_mu=np.asarray(self.log_mu, np.float32) if capture else None,
            support=SupportTable.from_rows(self.supports) if capture else None,
            full_logprobs=np.asarray(self.full_logprobs, np.float32) if req.return_logprob else None,
            # one version unless an update applied while generation was paused (engine/pausing.py)
            weight_versions=self.version_spans(weight_version),
            text=text,
            support_row_logprobs=list(self.support_row_logprobs) if support_mode else None,
            routed_experts=routed,
            routed_experts_history=list(self.routing_history) if routed is not None else None,
            sampler=sampler_record(req, semantics=semantics, version=version) if capture else None,
            top_logprobs=list(self.top_logprobs) if req.top_logprobs else None,
        )
