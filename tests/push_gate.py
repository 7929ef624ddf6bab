"""The in-flight-update tests' push gate: an explicit hold, so that a weight push always lands among running requests.

Under ``--async-rollout`` the next rollout is sampled while the trainer updates, and its push (``retract`` or
``in_place``) should land while that rollout's requests run, so that their samples hold tokens of two versions.
Whether they were still running then was a race with the machine (the tests slowed each decode step by 20 ms and
hoped the update was quicker than the generation). With the gate, the engine does not decode a rollout's requests
(rollouts from 1 on: rollout 0 is sampled before any update) while its weights are still those the rollout began
under: each has its first token (sampled at admission) and waits; the update the trainer pushes after training
the rollout before is the only way on, and every request then goes on under the new weights. Rollout r's
generation runs beside the update of rollout r - 1, which pushes unless it failed: a test whose run fails on
purpose gates only the rollouts before the failure (``rollouts``), or the failed run would wait for ever on a rollout
it has already given up.

A request's rollout is read from its rid (``.../{rollout}/{k}/{attempt}``, rollout/generate.py; an agent turn's
too). Installed on the engine classes of this process (``install``), or in another process through
``tests/gate_site`` with ``SUPPORT_REPLAY_TEST_PUSH_GATE=1`` (a started ``serve``)."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

ENV = "SUPPORT_REPLAY_TEST_PUSH_GATE"
GATE_SITE = Path(__file__).parent / "gate_site"
RID = re.compile(r"/(\d+)/\d+/\d+$")


class PushGate:
    def __init__(self, rollouts: set[int] | None = None):
        self.rollouts = rollouts  # those gated (None: every one from 1 on)
        self.lock = threading.Lock()
        self.began_under: dict[int, str] = {}  # rollout -> the weight version its first request met
        self.released: set[int] = set()  # rollouts whose engine has since taken newer weights
        self.held_steps = 0  # decode steps skipped, over the gate's life
        self.restore = None

    def _waiting(self, engine, row) -> bool:
        match = row.request.rid and RID.search(row.request.rid)
        if not match or int(match[1]) == 0 or (self.rollouts is not None and int(match[1]) not in self.rollouts):
            return False
        rollout = int(match[1])
        with self.lock:
            if rollout in self.released:
                return False
            began = self.began_under.setdefault(rollout, engine.weight_version)
            if engine.weight_version != began:
                self.released.add(rollout)
                return False
            return True

    def decode(self, original, engine) -> None:
        rows = engine.batch.rows
        if rows and all(self._waiting(engine, row) for row in rows):
            self.held_steps += 1
            time.sleep(0.001)  # the loop goes round for the update; nothing is decoded meanwhile
            return None
        return original(engine)

    def install(self) -> PushGate:
        from support_replay.engine.engine import Engine

        decode = Engine._decode
        Engine._decode = lambda engine: self.decode(decode, engine)

        def restore():
            Engine._decode = decode

        self.restore = restore
        print(f"push gate: installed in {sys.argv[0]}", file=sys.stderr, flush=True)
        return self

    def uninstall(self) -> None:
        if self.restore is not None:
            self.restore()
            self.restore = None


def from_environment() -> PushGate:
    """The gate, installed (tests/gate_site/sitecustomize.py)."""
    return PushGate().install()


def environment() -> dict[str, str]:
    """The environment a started process needs for the gate: this folder's gate_site first on its path."""
    return {ENV: "1", "PYTHONPATH": os.pathsep.join([str(GATE_SITE), os.environ.get("PYTHONPATH", "")])}
