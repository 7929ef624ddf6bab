"""The driver's watch over the engines: a death Ray reports drops the engine from the router; the engine Ray
restarted rejoins it with the current weights (router_membership.py).

One ``info`` call is kept in flight per engine actor. It fails when Ray reports the actor dead (the router stops
sending it requests: those in flight there already fail over to the others); the next one waits while Ray
restarts it and comes back from its new life, whose address the router admits once the engine holds the weight
version the others hold. Every event is printed with its time, and counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayError


@dataclass
class Watched:
    name: str
    actor: object
    url: str
    started: float
    pending: object = None
    deaths: int = 0
    down: bool = False
    events: list = field(default_factory=list)


class Supervisor:
    def __init__(self, router, engines: list[tuple[str, object, dict]], poll: float = 0.5):
        self.router, self.poll = router, poll
        self.engines = [Watched(name, actor, info["url"], info["started"]) for name, actor, info in engines]
        self.restarts = 0
        self._next = 0.0

    def check(self) -> None:
        """One look at every engine; call it often (it returns at once)."""
        now = time.monotonic()
        for e in self.engines:
            if e.pending is None:
                if now >= self._next:
                    e.pending = e.actor.info.remote()
                continue
            ready, _ = ray.wait([e.pending], timeout=0)
            if not ready:
                continue
            ref, e.pending = e.pending, None
            try:
                info = ray.get(ref)
            except RayActorError as exc:  # dead, or restarting (ActorUnavailableError): asked again at the next look
                if not e.down:
                    self._died(e, exc)
                continue
            if info["started"] != e.started:
                self._rejoin(e, info)
        if now >= self._next:
            self._next = now + self.poll
            self._readmit()

    def _died(self, e: Watched, exc: Exception) -> None:
        e.deaths, e.down = e.deaths + 1, True
        why = str(exc).strip().splitlines()[0][:200]
        self._say(e, f"died ({why}); out of the router until Ray restarts it")
        ray.get(self.router.drop.remote(e.url))

    def _rejoin(self, e: Watched, info: dict) -> None:
        """Its next life into the router; if the router refuses it (RejoinError: a replayed call failed, another
        version), the next look tries again."""
        try:
            version = ray.get(self.router.rejoin.remote(info["url"], e.url))
        except RayError as exc:
            self._say(e, f"restarted at {info['url']} but not admitted yet: {str(exc).strip().splitlines()[-1][:200]}")
            return
        e.url, e.started, e.down = info["url"], info["started"], False
        self.restarts += 1
        self._say(
            e,
            f"restarted by Ray on node {info['node_id'][:12]} pid {info['pid']} at {e.url}; rejoined the "
            f"router at weight_version {version!r}",
        )

    def _readmit(self) -> None:
        """An engine alive in its same life that the router dropped (a broadcast could not reach it for a
        moment): back through the same replay."""
        left = set(ray.get(self.router.left.remote()))
        for e in self.engines:
            if e.down or e.url not in left:
                continue
            try:
                version = ray.get(self.router.rejoin.remote(e.url, None))
                self._say(e, f"left the router while alive; readmitted at weight_version {version!r}")
            except RayError as exc:
                self._say(e, f"left the router while alive; not readmitted yet: {str(exc).strip()[-200:]}")

    def _say(self, e: Watched, what: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} ray-run: {e.name} {what}"
        e.events.append(line)
        print(line, flush=True)
