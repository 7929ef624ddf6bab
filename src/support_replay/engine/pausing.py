"""Pausing generation between decode steps, SGLang's ``/pause_generation`` and ``/continue_generation``
(0.5.23, ``managers/io_struct.py`` ``PauseGenerationReqInput`` and ``managers/scheduler.py``), so that weights can
change under running requests without throwing their tokens away. A mixin of ``Engine`` (engine.py).

Modes, as SGLang names them:

- ``abort``: every request queued or running fails with ``AbortedError`` (its tokens are lost);
- ``retract``: the running rows leave the batch and their keys and values are freed; on continue they are
  prefilled again, prompt and outputs so far, under the weights current then, and go on sampling from there:
  each later token is sampled from exactly pi_new(. | prefix). The recompute is one prefill of every
  retracted row (bucketed by length like any prefill), before any new request is admitted: one forward over
  ``prompt + outputs`` positions per row;
- ``in_place``: the rows stay with their keys and values; after an update they go on with the old weights'
  keys and values of their prefix under the new weights (a mismatch the trainer's ``--ci-test`` names).
  The deterministic engine (true-on-policy mode) refuses an update under an ``in_place`` pause with rows.

While paused nothing is admitted or decoded; weight updates (and version names) apply at once, ahead of the
requests waiting, and every live row records which version sampled which of its tokens (``weight_versions``
spans). A request submitted while paused waits for continue.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from ..errors import AbortedError, EngineError, RequestError

PAUSE_MODES = ("abort", "retract", "in_place")


class Pausing:
    def _init_pausing(self) -> None:
        self.paused: str | None = None  # the mode of the pause in force, or None
        # pause, continue and between-step calls, applied in order: (kind, the pause's mode or the call, its future)
        self._controls: list[tuple[str, object, Future]] = []
        self._controls_lock = threading.Lock()
        self._retracted: list = []  # RunningRequests out of the batch until continue (their KV freed)

    def pause_generation(self, mode: str = "abort") -> Future:
        """Pause before the next decode step; resolves to the number of requests it paused (retracted, kept in
        place, or aborted)."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        return self._control("pause", mode)

    def continue_generation(self) -> Future:
        """Resume: retracted rows are prefilled again under the current weights first; resolves to how many."""
        return self._control("continue", None)

    def call_between_steps(self, fn) -> Future:
        """``fn()`` on the engine's thread between two steps (paused or not), nothing else running on the model;
        resolves to what it returns (a teacher's scoring forward, engine/support_scoring.py)."""
        return self._control("call", fn)

    def _control(self, kind: str, arg) -> Future:
        future: Future = Future()
        with self._controls_lock:
            self._controls.append((kind, arg, future))
        return future

    def _apply_controls(self) -> None:
        with self._controls_lock:
            controls, self._controls = self._controls, []
        for kind, arg, future in controls:
            try:
                if kind == "call":
                    future.set_result(arg())
                else:
                    future.set_result(self._pause(arg) if kind == "pause" else self._continue())
            except Exception as exc:
                future.set_exception(exc)

    def _pause(self, mode: str) -> int:
        self.paused = mode
        if mode == "abort":
            rows = len(self.batch) + len(self._retracted) + self.ledger.queued
            self.ledger.abort_all()
            for seq in [*self.batch.rows, *self._retracted]:
                seq.fail(AbortedError("generation was paused with mode 'abort'"), "aborted")
            self._retire()
            for seq in self._retracted:
                self._finish_failed(seq.request, seq.future, *seq.failure)
            self._retracted = []
            self._step_paused(block=False)  # the waiting ones are answered now, not at continue
            return rows
        if mode == "retract":
            self._retracted = [*self._retracted, *self.batch.clear()]  # their blocks go back to the pool
            return len(self._retracted)
        return len(self.batch)

    def _continue(self) -> int:
        self.paused = None
        rows, self._retracted = self._retracted, []
        if rows:
            self._recompute(rows)
        return len(rows)

    def _step_paused(self, block: bool) -> None:
        """A step while paused: updates apply at once (in their order), aborted waiting requests are answered,
        nothing else runs."""
        updates = self.scheduler.take_paused(self._aborted_waiting)
        if self.scheduler.update is not None:  # taken before the pause, waiting for the batch to drain
            updates.insert(0, self.scheduler.update)
            self.scheduler.update = None
        for payload, future in updates:
            if self.deterministic and self.paused == "in_place" and self.batch and payload[0] is not None:
                future.set_exception(
                    EngineError(
                        "update_weights: generation is paused with mode 'in_place' and "
                        f"{len(self.batch)} requests keep the old weights' keys and values; the deterministic "
                        "engine (true-on-policy mode) samples every token from the new weights exactly: pause "
                        "with mode 'retract' (their keys and values are recomputed on continue)"
                    )
                )
                continue
            before = self.weight_version
            self._apply_update(payload, future)
            if self.weight_version != before:
                for seq in [*self.batch.rows, *self._retracted]:
                    seq.new_version(before)
        if block and not updates:
            time.sleep(0.01)  # nothing runs while paused: no busy loop
