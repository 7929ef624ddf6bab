"""The partial-rollout tests' stop gate: an explicit hold, so that a rollout's stop always finds requests unfinished.

Partial rollouts stop the requests still running once ``target`` groups have finished. Whether any are still running
then was a race with the machine: the tiny model's requests take milliseconds, and on a fast CPU every one had
finished before the stop landed (a Zen 4 failed ``stopped_requests > 0`` so). With the gate, the engine holds the
requests of a rollout's highest group (the last sent: never one kept from an earlier rollout, whose numbers are
lower, and whose continued requests are never held: a kept group may be one the stop waits for) in its queue,
unadmitted, until a stop for that rollout arrives; the rest run. Those rest hold ``target`` finished groups whenever
a rollout sends more than ``target`` running groups (the gated tests' configurations; with several engines each
holds its own highest, and the configurations leave ``target`` groups free), so the stop comes, finds the held
requests, and each is admitted and stopped after its first token (the engine's rule for a stop that finds its
request waiting): it is kept, and continued under the next weights.

A partial request is known by its rid, ``{prefix}/partial/{rollout}/{k}/{attempt}`` (rollout/generate.py), its group
by ``k // n_samples``, a continuation by ``attempt > 0``. A stop that comes before its request (over HTTP the abort
may overtake the request it names) is remembered and applied on arrival. Installed on the engine classes of this
process (``install``, for in-process engines), or in another process through ``tests/gate_site`` on its PYTHONPATH
with ``SUPPORT_REPLAY_TEST_STOP_GATE=<n_samples>`` in its environment (a started ``serve``, ray-run's engine
actors)."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

ENV = "SUPPORT_REPLAY_TEST_STOP_GATE"  # "<samples per group>" or "<samples per group>:<rollout>,<rollout>..."
GATE_SITE = Path(__file__).parent / "gate_site"
PARTIAL_RID = re.compile(r"/partial/(\d+)/(\d+)/(\d+)$")


class StopGate:
    def __init__(self, n_samples: int, rollouts: set[int] | None = None):
        self.n, self.rollouts = n_samples, rollouts  # rollouts: those gated (None: every one)
        self.lock = threading.Lock()
        self.held: dict[int, tuple[int, list]] = {}  # rollout -> (its highest group, the put() calls held)
        self.released: set[int] = set()  # rollouts whose stop has come
        self.stopped_early: set[str] = set()  # rids stopped before they arrived
        self.rollout_of: dict = {}  # future -> its rollout, for every partial request that arrived
        self.holds = 0  # requests held, over the gate's life
        self.restore = None

    def _where(self, request) -> tuple[int, int] | None:
        match = request.rid and PARTIAL_RID.search(request.rid)
        if not match or int(match[3]) > 0 or (self.rollouts is not None and int(match[1]) not in self.rollouts):
            return None  # not partial, a kept sample's continuation (never held), or a rollout not gated
        return int(match[1]), int(match[2]) // self.n

    def put(self, original, scheduler, kind, payload, future) -> None:
        where = self._where(payload) if kind == "generate" else None
        if where is None:
            return original(scheduler, kind, payload, future)
        rollout, group = where
        let_go, stop_now = [], False
        with self.lock:
            self.rollout_of[future] = rollout
            if payload.rid in self.stopped_early:
                self.stopped_early.discard(payload.rid)
                let_go, stop_now = [(scheduler, kind, payload, future)], True
            elif rollout in self.released:
                let_go = [(scheduler, kind, payload, future)]
            else:
                highest, held = self.held.get(rollout, (-1, []))
                if group > highest:  # the highest so far is held; the one held before goes
                    self.held[rollout] = (group, [(scheduler, kind, payload, future)])
                    let_go = held
                elif group == highest:
                    held.append((scheduler, kind, payload, future))
                else:
                    let_go = [(scheduler, kind, payload, future)]
                self.holds += group >= highest
        for item in let_go:
            original(*item)
        if stop_now:
            scheduler.ledger.stop(future)

    def _release(self, rollout: int) -> None:
        """The rollout's stop has come: its held requests join the queue (each then stopped when its own stop comes)."""
        with self.lock:
            self.released.add(rollout)
            _, held = self.held.pop(rollout, (-1, []))
        for scheduler, kind, payload, future in held:
            self._original_put(scheduler, kind, payload, future)

    def stop(self, original, engine, future) -> bool:
        with self.lock:
            rollout = self.rollout_of.get(future)
        if rollout is not None:
            self._release(rollout)
        return original(engine, future)

    def stop_request(self, original, engine, rid) -> int:
        match = rid and PARTIAL_RID.search(rid)
        if match:
            self._release(int(match[1]))
            if engine.ledger.running_future(rid) is None:
                with self.lock:
                    self.stopped_early.add(rid)
        return original(engine, rid)

    def install(self) -> StopGate:
        """Wrap this process's engine classes (undone by ``uninstall``)."""
        from support_replay.engine.engine import Engine
        from support_replay.engine.scheduler import Scheduler

        saved = (Scheduler.put, Engine.stop, Engine.stop_request)
        put, stop, stop_request = saved
        self._original_put = put
        Scheduler.put = lambda scheduler, kind, payload, future: self.put(put, scheduler, kind, payload, future)
        Engine.stop = lambda engine, future: self.stop(stop, engine, future)
        Engine.stop_request = lambda engine, rid=None: self.stop_request(stop_request, engine, rid)

        def restore():
            Scheduler.put, Engine.stop, Engine.stop_request = saved

        self.restore = restore
        print(f"stop gate: installed in {sys.argv[0]} ({self.n} samples a group)", file=sys.stderr, flush=True)
        return self

    def uninstall(self) -> None:
        if self.restore is not None:
            self.restore()
            self.restore = None


def from_environment() -> StopGate:
    """The gate ``SUPPORT_REPLAY_TEST_STOP_GATE`` describes, installed (tests/gate_site/sitecustomize.py)."""
    n, _, rollouts = os.environ[ENV].partition(":")
    return StopGate(int(n), {int(r) for r in rollouts.split(",")} if rollouts else None).install()


def environment(n_samples: int, rollouts: set[int] | None = None) -> dict[str, str]:
    """The environment a started process needs for the gate: this folder's gate_site first on its path."""
    value = f"{n_samples}:{','.join(map(str, sorted(rollouts)))}" if rollouts else str(n_samples)
    return {ENV: value, "PYTHONPATH": os.pathsep.join([str(GATE_SITE), os.environ.get("PYTHONPATH", "")])}
