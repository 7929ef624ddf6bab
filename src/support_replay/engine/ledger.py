"""The engine's books, under one lock: how many requests wait, which request ids are running or
were answered lately, which clients went away, and the counters ``/metrics`` reads.

Callers on any thread (the server's handlers submit and abort) and the engine's loop (which
takes, finishes and fails requests) meet only here.

A request id (``rid``) names one request: sent again with the same body (a client or router
retry) it gets the first copy's answer, on a future of its own, so the copy's client going away
never aborts the original; sent with another body it is refused (409). Answers are kept for
repeated ids within a count and a byte budget, and only until the weights change. Aborts are
recorded on the future itself, and only while it is queued or running: a finished future leaves
nothing behind.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

from ..errors import AbortedError, CapacityError, OverloadedError, RequestConflict
from ..protocol import Completion, GenerateRequest

FINISHED_RIDS_KEPT = 4096  # answers kept for a request id sent again (a client or router retry)
FINISHED_RIDS_BYTES = 256 * 2**20  # and the bytes they may hold (one full-capacity capture is ~67 MB)


@dataclass
class EngineStats:
    requests: dict = field(default_factory=lambda: {"ok": 0, "refused": 0, "overloaded": 0, "failed": 0, "aborted": 0})
    generated_tokens: int = 0
    capture_failures: int = 0
    duplicates: int = 0


NOT_THE_ANSWER = frozenset({"rid", "routing_key"})  # a request's name and its session's engine


def fingerprint(request: GenerateRequest) -> bytes:
    """What makes two requests the same request: every field but its id and routing key (one left out, such as
    ``return_routed_experts`` was, let a retry with it get the answer of the request without it)."""
    key = tuple((f.name, getattr(request, f.name)) for f in fields(request) if f.name not in NOT_THE_ANSWER)
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()


def completion_bytes(c: Completion) -> int:
    """Roughly what a kept answer holds in memory."""
    total = 8 * len(c.output_ids) + len(c.text)
    for array in (c.log_mu, c.full_logprobs):
        total += 0 if array is None else array.nbytes
    if c.support is not None:
        total += c.support.ids.nbytes + c.support.offsets.nbytes
    total += sum(row.nbytes for row in c.support_row_logprobs or [])
    return total


def _follow(original: Future) -> Future:
    """A future of its own that resolves as ``original`` does (a duplicate's client may cancel it freely)."""
    copy: Future = Future()

    def settle(done: Future) -> None:
        if copy.done():
            return
        exc = done.exception()
        copy.set_exception(exc) if exc is not None else copy.set_result(done.result())

    original.add_done_callback(settle)
    return copy


class Ledger:
    def __init__(self, max_queue: int, finished_bytes: int = FINISHED_RIDS_BYTES):
        self.max_queue = max_queue
        self.finished_bytes = finished_bytes
        self.lock = threading.Lock()
        self.queued = 0
        self.stats = EngineStats()
        self._running_rids: dict[str, tuple[bytes, Future, int]] = {}  # rid -> (fingerprint, future, epoch)
        self.epoch = 0  # weight updates so far: an answer is kept only under the weights it was enqueued with
        self._finished: OrderedDict[str, tuple[bytes, Completion, int]] = OrderedDict()
        self._finished_total = 0
        self._aborted: dict[Future, str] = {}  # futures to stop -> why (the client went away, a weight update)
        self._outstanding: set[Future] = set()  # every future queued or running, for abort_all
        self._stopped: set[Future] = set()  # to end now with what they have (a partial answer, not a failure)

    def enqueue(self, request: GenerateRequest, future: Future) -> Future | None:
        """Take ``request`` into the queue (returns None), or answer it now: a follower of its running
        copy, a finished copy's answer, 409 for an id that names another request, or 503 when the
        queue is full."""
        with self.lock:
            rid = request.rid
            if rid is not None and (rid in self._finished or rid in self._running_rids):
                mark = fingerprint(request)
                seen, answer = self._finished[rid][:2] if rid in self._finished else self._running_rids[rid][:2]
                if seen != mark:
                    self.stats.requests["refused"] += 1
                    future.set_exception(
                        RequestConflict(
                            f"rid: {rid!r:.80} already names another request (another prompt or other settings)"
                        )
                    )
                    return future
                self.stats.duplicates += 1
                if isinstance(answer, Future):
                    return _follow(answer)
                future.set_result(answer)
                return future
            if self.queued >= self.max_queue:
                self.stats.requests["overloaded"] += 1
                future.set_exception(OverloadedError.queue_full(self.max_queue))
                return future
            self.queued += 1
            self._outstanding.add(future)
            if rid is not None:
                self._running_rids[rid] = (fingerprint(request), future, self.epoch)
        return None

    def dequeue(self, future: Future) -> str | None:
        """A request leaves the queue for a slot; returns why it was aborted meanwhile, or None."""
        with self.lock:
            self.queued -= 1
            return self._aborted.get(future)

    def abort(self, future: Future, why: str = "the client went away") -> None:
        with self.lock:
            if future in self._outstanding:  # a finished or unknown future: nothing to stop, nothing kept
                self._aborted.setdefault(future, why)

    def abort_all(self) -> int:
        """Abort every request queued or running now (a weight update that does not wait); returns how many."""
        with self.lock:
            for f in self._outstanding:
                self._aborted.setdefault(f, "a weight update aborted it (abort mode)")
            return len(self._outstanding)

    def stop(self, future: Future) -> bool:
        """End ``future``'s request at the next step with the tokens it has (SGLang's ``/abort_request``: the answer
        so far, finish reason ``abort``); False when it is not queued or running."""
        with self.lock:
            if future in self._outstanding:
                self._stopped.add(future)
                return True
            return False

    def running_future(self, rid: str) -> Future | None:
        """The future of the request named ``rid`` while it is queued or running."""
        with self.lock:
            entry = self._running_rids.get(rid)
            return entry[1] if entry is not None and entry[1] in self._outstanding else None

    def outstanding(self) -> list[Future]:
        with self.lock:
            return list(self._outstanding)

    def stopped(self, futures) -> set[Future]:
        """Those among ``futures`` to end now with what they have."""
        with self.lock:
            return {f for f in futures if f in self._stopped}

    def aborted(self, futures) -> dict[Future, str]:
        """``{future: why}`` of those among ``futures`` to stop."""
        with self.lock:
            return {f: self._aborted[f] for f in futures if f in self._aborted}

    def count(self, kind: str) -> None:
        with self.lock:
            self.stats.requests[kind] += 1

    def finished(self, request: GenerateRequest, future: Future, completion: Completion) -> None:
        with self.lock:
            self.stats.requests["ok"] += 1
            self.stats.generated_tokens += completion.num_tokens
            if request.rid is not None:
                mark, _, epoch = self._running_rids.pop(request.rid, (fingerprint(request), None, self.epoch))
                if epoch == self.epoch:  # an answer begun under older weights is not kept past their update
                    size = completion_bytes(completion)
                    self._finished[request.rid] = (mark, completion, size)
                    self._finished_total += size
                while self._finished and (
                    len(self._finished) > FINISHED_RIDS_KEPT or self._finished_total > self.finished_bytes
                ):
                    self._finished_total -= self._finished.popitem(last=False)[1][2]
            self._forget(future)

    def new_weights(self) -> None:
        """A weight update applied: answers kept for repeated ids were sampled by the old weights; forget them."""
        with self.lock:
            self.epoch += 1
            self._finished.clear()
            self._finished_total = 0

    def failed(self, request: GenerateRequest, future: Future, exc: Exception) -> None:
        with self.lock:
            self.stats.requests["aborted" if isinstance(exc, AbortedError) else "failed"] += 1
            self.stats.capture_failures += isinstance(exc, CapacityError)
            if request.rid is not None:
                self._running_rids.pop(request.rid, None)
            self._forget(future)

    def _forget(self, future: Future) -> None:
        self._aborted.pop(future, None)
        self._stopped.discard(future)
        self._outstanding.discard(future)

    def snapshot(self) -> tuple[dict, int, int, int, int]:
        """``(requests by outcome, generated tokens, capture failures, duplicates, queued)``, consistent."""
        with self.lock:
            s = self.stats
            return dict(s.requests), s.generated_tokens, s.capture_failures, s.duplicates, self.queued
