"""The in-process engine as an engine kind: built in this process from the run's checkpoint, weights handed
over as tensors in memory (colocated rollouts; the default without ``--rollout-url``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from .kind import EngineKind, Needs, WeightRoute
from .weight_push import IN_FLIGHT_MODES


@dataclass(frozen=True)
class InProcessEngine:
    """What the engine in this process is built from: the checkpoint, its dtype, and the engine's settings
    (``engine/settings.py``)."""

    checkpoint: Path
    dtype: str
    settings: object  # EngineSettings (imported with the engine, on connect)


class InProcessSync:
    def __init__(self, engine, mode: str = "wait"):
        self.engine, self.mode, self.abort = engine, mode, mode == "abort"

    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        """The weights once the batch drained (``wait``), at once after aborting it (``abort``), or under the
        running requests (``retract``, ``in_place``: paused, loaded, continued; engine/pausing.py)."""
        engine = self.engine
        pause = engine.pause_generation(self.mode) if self.mode in IN_FLIGHT_MODES else None
        update = engine.update_weights(state, version, abort_all_requests=self.abort)
        try:
            engine.wait([f for f in (pause, update) if f is not None])  # runs the steps here without a loop thread
        finally:
            if pause is not None:
                resumed = engine.continue_generation()
                engine.wait([resumed])
                resumed.result()
        update.result()


class InProcessKind(EngineKind):
    name = "in-process"
    remote = False
    deterministic = True

    @property
    def where(self) -> str:
        return "in-process engine"

    def connect(self, needs: Needs):
        from ..engine import Engine  # the only place a run imports the engine
        from .local import EngineBackend

        built = self.in_process
        settings = built.settings.but(
            weight_version=needs.weight_version,
            **({"kv_share": needs.kv_share} if needs.kv_share is not None else {}),
        )
        self.engine = Engine.from_pretrained(built.checkpoint, settings, dtype=getattr(torch, built.dtype))
        self.backend = EngineBackend(self.engine)
        return self.backend

    def identity(self) -> dict:
        semantics = self.in_process.settings.semantics
        return {"name": "support-replay (in-process)", "version": __version__, "semantics": semantics}

    def penalty_semantics(self, penalties, fallback: str) -> str:
        return fallback  # this engine samples with the run's own semantics

    def weight_sync(self, route: WeightRoute):
        return InProcessSync(self.engine, route.mode)
