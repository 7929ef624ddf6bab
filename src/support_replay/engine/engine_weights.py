"""The weights half of the engine: full weights (from disk or memory), LoRA adapters, a version's name and the
prefix cache's flush, each queued in order with the requests (an update applies once the batch submitted before it
has drained) and applied by the loop between steps. A mixin of ``Engine`` (engine.py)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path

import torch

from ..errors import EngineError, RequestError
from .lora_adapter import read_adapter
from .weight_updates import CheckedPath, load_update

log = logging.getLogger(__name__)


class EngineWeights:
    def update_weights_from_disk(
        self, path: str | Path | CheckedPath, version: str | None = None, *, abort_all_requests: bool = False
    ) -> Future:
        """Load safetensors weights once the running batch has drained; resolves to the version.

        ``version`` names the new weights (the trainer's string); without one the engine
        keeps its current name, as SGLang does. ``abort_all_requests`` (SGLang's field) fails
        every request queued or running now with ``AbortedError`` instead of letting them
        finish on the old weights, so the update applies at the next step.
        """
        source = path if isinstance(path, CheckedPath) else Path(path)
        return self._queue_update(source, version, abort_all_requests)

    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: str | None = None, *, abort_all_requests: bool = False
    ) -> Future:
        """Same as ``update_weights_from_disk`` with tensors in memory (colocated trainer)."""
        return self._queue_update(state_dict, version, abort_all_requests)

    def load_lora_adapter(self, name: str, path: str | Path) -> Future:
        """SGLang's ``/load_lora_adapter``: the adapter at ``path`` merged into the weights once the running
        batch has drained (engine/lora_adapter.py); resolves to the weight version."""
        adapter = read_adapter(name, path, self.runner.model)  # a bad adapter is refused before it queues
        with self._adapter_lock:
            self.adapters.queue_load(adapter)
            return self._queue_update(lambda model: self.adapters.merged(adapter, model), None, False, adapter=True)

    def unload_lora_adapter(self, name: str) -> Future:
        """SGLang's ``/unload_lora_adapter``: the base weights back, bit for bit, once the batch has drained."""
        with self._adapter_lock:
            self.adapters.queue_unload(name)
            return self._queue_update(lambda model: self.adapters.restored(), None, False, adapter=True)

    def _queue_update(self, source, version: str | None, abort_all_requests: bool, adapter: bool = False) -> Future:
        if self.adapters.queued is not None and not adapter:
            raise RequestError(
                f"weights: adapter {self.adapters.queued.name!r} is merged into the weights; unload it before "
                "loading other weights (its base would be stale)"
            )
        future: Future = Future()
        if abort_all_requests:
            aborted = self.ledger.abort_all()
            log.info("weight update to %s aborts %d requests", version, aborted)
        self.scheduler.put("update", (source, version), future)
        return future

    def flush_prefix_cache(self) -> int:
        """Empty the prefix cache at the start of the loop's next step, and at the latest before its next admission
        (``/flush_cache``); the entries it held now."""
        self._flush_cache = True
        return len(self.prefix_cache.entries)

    def update_weight_version(self, version: str) -> Future:
        """Rename the current weights (SGLang's ``/update_weight_version``), in queue order like an update."""
        future: Future = Future()
        self.scheduler.put("update", (None, version), future)
        return future

    def release_packed_weights(self) -> None:
        """Frees the decode step's packed weight copies (engine/fused_step.py) until the next decode
        step packs them again. A colocated trainer calls it before it trains: its weight push makes
        them stale anyway, and the update's peak memory need not hold them. Safe beside a running
        step: a step keeps the packs it started with, and a missing pack means the plain weight."""
        if self.runner.fused is not None:
            self.runner.fused.drop_packs()

    def _apply_update(self, arg, future) -> None:
        source, version = arg
        self.prefix_cache.new_weights()  # keys and values of other weights (or another version's name) are not these
        self.ledger.new_weights()  # nor are the answers kept for repeated request ids
        try:
            load_update(self.runner.model, source)
            if version is not None:
                self.weight_version = str(version)
            future.set_result(self.weight_version)
        except Exception as exc:
            future.set_exception(exc if isinstance(exc, EngineError) else EngineError(f"update_weights: {exc}"))
