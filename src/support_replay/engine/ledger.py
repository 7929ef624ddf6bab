"""The engine's books, under one lock: how many requests wait, which request ids are running or
were answered lately, which clients went away, and the counters ``/metrics`` reads.

Callers on any thread (the server's handlers submit and abort) and the engine's loop (which
takes, finishes and fails requests) meet only here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import AbortedError, CapacityError, OverloadedError
from ..protocol import Completion, GenerateRequest

FINISHED_RIDS_KEPT = 4096  # answers kept for a request id sent again (a client or router retry)


@dataclass
class EngineStats:
    requests: dict = field(default_factory=lambda: {"ok": 0, "refused": 0, "overloaded": 0, "failed": 0, "aborted": 0})
    generated_tokens: int = 0
    capture_failures: int = 0
    duplicates: int = 0


class Ledger:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.lock = threading.Lock()
        self.queued = 0
        self.stats = EngineStats()
        self._running_rids: dict[str, Future] = {}
        self._finished: OrderedDict[str, Completion] = OrderedDict()
        self._aborted: dict[int, str] = {}  # ids of futures to stop -> why (the client went away, a weight update)
        self._outstanding: dict[int, Future] = {}  # every future queued or running, for abort_all

    def enqueue(self, request: GenerateRequest, future: Future) -> Future | None:
        """Take ``request`` into the queue (returns None), or answer it now: the future of its
        running copy, a finished copy's answer, or 503 when the queue is full."""
        with self.lock:
            if request.rid is not None and request.rid in self._finished:
                self.stats.duplicates += 1
                future.set_result(self._finished[request.rid])
                return future
            if request.rid is not None and request.rid in self._running_rids:
                self.stats.duplicates += 1
                return self._running_rids[request.rid]
            if self.queued >= self.max_queue:
                self.stats.requests["overloaded"] += 1
                future.set_exception(OverloadedError(f"the admission queue is full ({self.max_queue} waiting); retry later"))
                return future
            self.queued += 1
            self._outstanding[id(future)] = future
            if request.rid is not None:
                self._running_rids[request.rid] = future
        return None

    def dequeue(self, future: Future) -> str | None:
        """A request leaves the queue for a slot; returns why it was aborted meanwhile, or None."""
        with self.lock:
            self.queued -= 1
            return self._aborted.get(id(future))

    def abort(self, future: Future, why: str = "the client went away") -> None:
        with self.lock:
            self._aborted.setdefault(id(future), why)

    def abort_all(self) -> int:
        """Abort every request queued or running now (a weight update that does not wait); returns how many."""
        with self.lock:
            for key in self._outstanding:
                self._aborted.setdefault(key, "a weight update aborted it (abort mode)")
            return len(self._outstanding)

    def aborted(self, futures) -> dict[int, str]:
        """``{id(future): why}`` of those among ``futures`` to stop."""
        with self.lock:
            return {id(f): self._aborted[id(f)] for f in futures if id(f) in self._aborted}

    def count(self, kind: str) -> None:
        with self.lock:
            self.stats.requests[kind] += 1

    def finished(self, request: GenerateRequest, future: Future, completion: Completion) -> None:
        with self.lock:
            self.stats.requests["ok"] += 1
            self.stats.generated_tokens += completion.num_tokens
            if request.rid is not None:
                self._running_rids.pop(request.rid, None)
                self._finished[request.rid] = completion
                while len(self._finished) > FINISHED_RIDS_KEPT:
                    self._finished.popitem(last=False)
            self._aborted.pop(id(future), None)
            self._outstanding.pop(id(future), None)

    def failed(self, request: GenerateRequest, future: Future, exc: Exception) -> None:
        with self.lock:
            self.stats.requests["aborted" if isinstance(exc, AbortedError) else "failed"] += 1
            self.stats.capture_failures += isinstance(exc, CapacityError)
            if request.rid is not None:
                self._running_rids.pop(request.rid, None)
            self._aborted.pop(id(future), None)
            self._outstanding.pop(id(future), None)

    def snapshot(self) -> tuple[dict, int, int, int, int]:
        """``(requests by outcome, generated tokens, capture failures, duplicates, queued)``, consistent."""
        with self.lock:
            s = self.stats
            return dict(s.requests), s.generated_tokens, s.capture_failures, s.duplicates, self.queued
