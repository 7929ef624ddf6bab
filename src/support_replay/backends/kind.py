"""What an engine kind is to the trainer and the audit: one small interface, every kind one class.

A kind owns everything that differs between engines: how it is reached and generates (its
``Backend``), the start-up handshake (which penalty semantics it samples with, whether it computes
the trainer's bits in true-on-policy mode, its name and version), how new weights reach it (full
weights and LoRA adapters), and which run settings it cannot serve. ``registry.py`` names the kinds;
``train/`` and ``audit/`` ask it for a connected kind and never look at the kind's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..core.routing import RoutingShape
from .base import Backend


@dataclass(frozen=True)
class Needs:
    """What a run asks of its engine when it connects (the engine's own settings come with the kind)."""

    vocab_size: int
    weight_version: str
    routing_shape: RoutingShape | None = None  # the trained model's, which captured routing must fit
    true_on_policy_dtype: str | None = None  # --true-on-policy-mode: the trainer's dtype the engine must compute in
    adapter: bool = False  # --lora-sync adapter: requests name the loaded adapter (ADAPTER_NAME)
    vllm_max_logprobs: int = 20  # processed log-probs asked per token where a request declares no top_k (the audit)
    kv_share: float | None = None  # the in-process engine's share of free memory for its KV cache (colocated)


@dataclass(frozen=True)
class WeightRoute:
    """How a run pushes weights: where staged files go, what happens to requests in flight, the transport."""

    staging: Path
    mode: str = "wait"  # WEIGHT_SYNC_MODES
    transport: str = "disk"  # disk: a directory the engine reads; http: the request body
    lora: object | None = None  # the LoRA settings with --lora-sync adapter (the adapter alone is pushed)


class EngineKind(ABC):
    """One kind of rollout engine. ``settings`` is the run's engine section (``--rollout-url``, the wire form,
    ...), ``in_process`` what an engine in this process is built from (only the in-process kind reads it)."""

    name: ClassVar[str]
    remote: ClassVar[bool] = True  # reached at --rollout-url (False: an engine in this process)
    deterministic: ClassVar[bool] = False  # can compute the trainer's bits (--true-on-policy-mode)
    started_by_launcher: ClassVar[bool] = False  # the engines `train --rollout-num-gpus-per-engine` starts speak it
    weights_over_http: ClassVar[bool] = False  # takes weights in a request body (--weight-transport http)

    def __init__(self, settings, in_process=None):
        self.settings, self.in_process = settings, in_process
        self.backend: Backend | None = None
        self.engine = None  # the in-process engine, for the kinds that hold one

    @classmethod
    def refusal(cls, settings, *, score_centering: bool) -> tuple[str, object, str] | None:
        """``(field, value, why)`` when a run setting is one this kind cannot serve, else None."""
        return None

    @property
    def reveals_whole_support(self) -> bool:
        """Whether it reveals the support of settings that keep the whole vocabulary (no top_k, top_p or min_p)."""
        return False

    @property
    def where(self) -> str:
        """The engine, for messages."""
        return f"{self.name} engine at {self.settings.rollout_url}"

    @abstractmethod
    def connect(self, needs: Needs) -> Backend:
        """The backend that generates (kept as ``self.backend``); the handshake runs here."""

    @abstractmethod
    def identity(self) -> dict:
        """The engine's name, version and filter semantics, as it reports them (the audit's report)."""

    @abstractmethod
    def penalty_semantics(self, penalties, fallback: str) -> str:
        """Whose penalty rules the engine samples with, or a ``ConfigError`` naming the engine and the setting when
        they are not ones whose code was read; ``fallback``: the run's declared semantics."""

    @abstractmethod
    def weight_sync(self, route: WeightRoute):
        """The object whose ``push(state or adapter, version)`` hands new weights to the engine."""

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
