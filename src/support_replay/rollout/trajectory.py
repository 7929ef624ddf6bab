"""The token record of one multi-turn sample: the prompt, then model turns and inserted spans.

Model tokens carry the support and log mu the engine captured; inserted tokens (tool output,
environment and user messages, chat-template glue) carry the singleton support, log mu 0 and
loss mask 0 (docs/contract.md). Nothing here re-tokenizes: spans are appended as ids.

Expert routing (MoE, routing replay): each turn's request routes the history again where no prefix
cache entry kept it, so a token decoded in turn t may be computed once more by the prefill of turn
t + 1, under other weights if a push came between (a continued partial sample is the same). The
trajectory keeps the final computation's routing, the one whose keys and values every later token
attended to, and each earlier one that routed its positions otherwise (``routing_history``): the
trainer scores every token under the routing that computed it. It counts how often a re-prefill
chose differently from the decode step (``routing_recomputed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.penalties import NO_PENALTIES, Penalties
from ..core.routing import FREE, needed_history
from ..core.support import SupportTable
from ..protocol import Completion, VersionSpan
from .sample import Sample


@dataclass
class Trajectory:
    prompt_ids: list[int]
    prompt_text: str
    capture: bool
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[np.ndarray] = field(default_factory=list)  # pieces, int8
    log_mu: list[np.ndarray] = field(default_factory=list)  # pieces, float32
    supports: list[SupportTable] = field(default_factory=list)  # pieces
    support_logq: list[np.ndarray] | None = field(default_factory=list)  # pieces; None once a turn lacks them
    spans: list[VersionSpan] = field(default_factory=list)
    versions_known: bool = True
    model_turns: int = 0
    support_bytes: int = 0  # what the model turns' supports cost on the wire
    penalties: Penalties = NO_PENALTIES
    output_starts: list[int] = field(default_factory=list)  # response positions where each model turn began
    finish_reason: dict | None = None
    routing: np.ndarray | None = None  # the last turn's: every fed position of the history (the final computation)
    routing_history: list[np.ndarray] = field(default_factory=list)  # earlier ones that routed otherwise (Sample's)
    routing_bytes: int = 0
    routing_recomputed: tuple[int, int] = (0, 0)  # (choices that differed, compared) for re-prefilled decoded tokens
    _decoded: tuple[int, int] = (0, 0)  # sequence positions [start, end) the last turn routed by decode steps

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def append_turn(self, inserted: list[int], completion: Completion) -> None:
        """Inserted ids (empty on the first turn), then the model's output with its capture."""
        start = len(self.response_ids)
        if inserted:
            self.response_ids += inserted
            self.loss_mask.append(np.zeros(len(inserted), np.int8))
            if self.capture:
                self.log_mu.append(np.zeros(len(inserted), np.float32))
                self.supports.append(SupportTable.singleton(inserted))
                if self.support_logq is not None:
                    self.support_logq.append(np.zeros(len(inserted), np.float32))  # log q = log 1 on {a_t}
        offset = len(self.response_ids)
        self.output_starts.append(offset)
        self.response_ids += completion.output_ids
        self.loss_mask.append(np.ones(completion.num_tokens, np.int8))
        if self.capture:
            self.log_mu.append(np.asarray(completion.log_mu, np.float32))
            self.supports.append(completion.support)
            rows = completion.support_row_logprobs
            if self.support_logq is not None and rows is not None:
                self.support_logq.append(np.concatenate(rows).astype(np.float32))
            else:
                self.support_logq = None
        self._add_spans(start, offset, completion.weight_versions)
        self.model_turns += 1
        self.support_bytes += completion.support_bytes
        self.finish_reason = completion.finish_reason
        if completion.routed_experts is not None:
            self._keep_routing(completion)

    def _keep_routing(self, completion: Completion) -> None:
        """The final computation's routing, the earlier ones that routed otherwise kept; the decoded tokens a
        prefill routed again compared with their first."""
        routed = completion.routed_experts
        start, end = self._decoded
        before = [] if self.routing is None else [self.routing]
        earlier = [*self.routing_history, *before, *(completion.routed_experts_history or [])]
        self.routing_history = needed_history(earlier, routed)
        if self.routing is not None and end > start:
            before, after = self.routing[start:end], routed[start:end]
            differ = int((np.sort(before, -1) != np.sort(after, -1)).any(-1).sum())
            self.routing_recomputed = (
                self.routing_recomputed[0] + differ,
                self.routing_recomputed[1] + before[..., 0].size,
            )
        first_output = len(self.ids) - completion.num_tokens  # the output's first token: fed at the first decode step
        self._decoded = (first_output, len(self.ids) - 1)
        self.routing = routed
        self.routing_bytes += completion.routing_bytes

    def _add_spans(self, start: int, offset: int, spans: list[VersionSpan]) -> None:
        # inserted tokens are context of the turn that follows them: they take its first version
        if not spans or not self.versions_known:
            self.versions_known, self.spans = False, []
            return
        for i, s in enumerate(spans):
            begin = start if i == 0 else offset + s.start
            if self.spans and self.spans[-1].version == s.version and self.spans[-1].end == begin:
                self.spans[-1] = VersionSpan(s.version, self.spans[-1].start, offset + s.end)
            else:
                self.spans.append(VersionSpan(s.version, begin, offset + s.end))

    def to_json(self) -> dict:
        """The token-level record for a trainer in another process (support as id lists)."""
        sample = self.to_sample(0, 0, reward=0.0, temperature=1.0)
        return {
            "prompt_ids": sample.prompt_ids,
            "response_ids": sample.response_ids,
            "loss_mask": sample.loss_mask.tolist(),
            "log_mu": sample.log_mu.tolist() if sample.log_mu is not None else None,
            "support": sample.support.to_lists() if sample.support is not None else None,
            "weight_versions": [s.to_json() for s in sample.weight_versions],
            "finish_reason": self.finish_reason,
            "model_turns": self.model_turns,
            # where each engine request's output began: the penalties' history restarts there
            "output_starts": sample.output_starts,
            "penalties": self.penalties.to_json(),
        }

    def to_sample(
        self,
        index: int,
        group: int,
        *,
        reward: float,
        temperature: float,
        label=None,
        response_text: str = "",
        metadata=None,
    ) -> Sample:
        truncated = (self.finish_reason or {}).get("type") == "length"
        return Sample(
            index=index,
            group=group,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=np.concatenate(self.loss_mask) if self.loss_mask else np.zeros(0, np.int8),
            reward=reward,
            status="truncated" if truncated else "completed",
            log_mu=np.concatenate(self.log_mu) if self.capture and self.log_mu else None,
            support=SupportTable.concat(self.supports) if self.capture and self.supports else None,
            temperature=temperature,
            label=label,
            prompt_text=self.prompt_text,
            response_text=response_text,
            weight_versions=list(self.spans) if self.versions_known else [],
            support_bytes=self.support_bytes,
            metadata=dict(metadata or {}),
            penalties=self.penalties,
            output_starts=list(self.output_starts) or [0],
            routing=self._sample_routing(),
            routing_history=list(self.routing_history),
            support_logq=np.concatenate(self.support_logq) if self.capture and self.support_logq else None,
            routing_bytes=self.routing_bytes,
            routing_recomputed=self.routing_recomputed,
        )

    def _sample_routing(self) -> np.ndarray | None:
        """Every fed position's routing; positions after the last model turn (inserted, never fed) FREE."""
        if self.routing is None:
            return None
        missing = len(self.ids) - 1 - len(self.routing)
        if missing <= 0:
            return self.routing.copy()
        free = np.full((missing, *self.routing.shape[1:]), FREE, np.int32)
        return np.concatenate([self.routing, free])
