"""Admission: one FIFO of requests and weight updates, taken in order while the batch and the KV
budget have room; prompts of like length prefilled together.

An update is taken like a request and then waits until the running batch has drained; requests
behind it wait for it (docs/engines.md). While generation is paused (engine/pausing.py) updates are
taken at once, ahead of the requests. A request that does not fit the KV budget now waits,
first in line, until rows leave.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..protocol import GenerateRequest
from .ledger import Ledger

PREFILL_PADDING = 2.0  # a prefill batch computes at most this many positions per real prompt token


def prefill_buckets(seqs: list, length: Callable = lambda s: len(s.request.input_ids)) -> list[list]:
    """``seqs`` in groups prefilled together: by prompt length, a group closing when left-padding it
    to its longest prompt would compute more than ``PREFILL_PADDING`` times its real tokens (one
    8,000-token prompt admitted with ten short ones would otherwise pad all eleven to 8,000). A
    GRPO group (one prompt, n times) stays whole: equal lengths pad nothing."""
    buckets, current, real = [], [], 0
    for seq in sorted(seqs, key=length):
        n = length(seq)
        if current and (len(current) + 1) * n > PREFILL_PADDING * (real + n):
            buckets.append(current)
            current, real = [], 0
        current.append(seq)
        real += n
    return buckets + [current] if current else buckets


class Scheduler:
    """The engine's inbox: ``("generate" | "update", payload, future)`` items in submission order."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._inbox: queue.Queue = queue.Queue()
        self._deferred: list = []  # taken out but not admitted (the KV budget had no room): first in line
        self.update: tuple | None = None  # ``(payload, future)`` of an update waiting for the batch to drain
        self.lock = threading.Lock()  # held while a list is queued and while the inbox is drained

    def put(self, kind: str, payload, future: Future) -> None:
        self._inbox.put((kind, payload, future))

    def take(
        self,
        room: int,
        block: bool,
        fits: Callable[[list[GenerateRequest], GenerateRequest], bool],
        aborted: Callable[[GenerateRequest, Future, str], None],
    ) -> list[tuple[GenerateRequest, Future]]:
        """Pop requests in order until ``room`` are taken, the next one does not ``fits`` beside those
        taken (it waits, first in line), or an update is next (it becomes ``self.update``). A request
        aborted while it waited is handed to ``aborted`` with the reason."""
        taken: list[tuple[GenerateRequest, Future]] = []
        if room <= 0:
            return taken
        try:
            item = self._next(timeout=0.05 if block else None)
        except queue.Empty:
            return taken
        with self.lock:  # a list being queued (submit_all) is whole before the rest is drained
            while True:
                kind, payload, future = item
                if kind == "update":
                    self.update = (payload, future)
                    break
                if not self.ledger.aborted([future]) and not fits([r for r, _ in taken], payload):
                    self._deferred.insert(0, item)
                    break
                why = self.ledger.dequeue(future)
                if why is not None:
                    aborted(payload, future, why)
                elif future.set_running_or_notify_cancel():
                    taken.append((payload, future))
                if len(taken) >= room:
                    break
                try:
                    item = self._next(timeout=None)
                except queue.Empty:
                    break
        return taken

    def take_paused(self, aborted: Callable[[GenerateRequest, Future, str], None]) -> list[tuple]:
        """While generation is paused (engine/pausing.py): the updates waiting, in their order, taken ahead of
        the requests, which stay queued in theirs; a waiting request aborted meanwhile is handed to ``aborted``."""
        updates = []
        with self.lock:
            items, self._deferred = self._deferred, []
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, payload, future in items:
                if kind == "update":
                    updates.append((payload, future))
                elif self.ledger.aborted([future]):
                    aborted(payload, future, self.ledger.dequeue(future))
                else:
                    self._deferred.append((kind, payload, future))
        return updates

    def _next(self, timeout: float | None):
        if self._deferred:
            return self._deferred.pop(0)
        return self._inbox.get(timeout=timeout) if timeout is not None else self._inbox.get_nowait()
