"""The in-process engine as a backend (colocated rollouts, tests).

A rollout of any size goes through: requests are queued as the engine's queue has room (in
order, so a GRPO group sent together still shares its prefill) and the rest wait here, never
refused for a full queue. The engine's 503 stays for callers that overload it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from ..engine import Engine
from ..errors import EngineError, EngineOverloaded, EngineUnavailable, OverloadedError, RequestError
from ..protocol import Completion, GenerateRequest, validate_completion


def ended_finished(future: Future) -> bool:
    """Whether a done request finished by itself (not failed, not stopped with what it had)."""
    if future.exception() is not None:
        return False
    return future.result().finish_reason.get("type") != "abort"


class EngineBackend:
    retries = 0  # in-process: nothing to send again

    def __init__(self, engine: Engine, timeout: float | None = None):
        self.engine = engine  # not started: generate runs its steps in the calling thread (Engine.wait)
        self.vocab_size = engine.vocab_size
        self.routing_shape = engine.runner.routing.shape if engine.runner.routing is not None else None
        self.timeout = timeout

    def generate(
        self, requests: list[GenerateRequest], *, return_exceptions: bool = False, on_done=None, partial: bool = False
    ) -> list:
        """A refused request raises; one the engine failed or dropped is ``EngineUnavailable``
        (in its place with ``return_exceptions``). ``on_done(i, finished)`` hears of each request as it ends
        (``finished``: not stopped, not failed), on the engine's thread; ``partial``: a stopped request's answer
        (finish reason ``abort``, the tokens it had) is returned like any other (``stop``)."""
        futures = self._submit_as_room_allows(requests, on_done)
        out = []
        for i, (req, future) in enumerate(zip(requests, futures)):
            try:
                out.append(validate_completion(future.result(), req, self.vocab_size, i, self.routing_shape))
            except RequestError:
                raise
            except EngineError as exc:
                kind = EngineOverloaded if isinstance(exc, OverloadedError) else EngineUnavailable
                failed = kind(f"completion {i}: {exc}")
                if not return_exceptions:
                    raise failed from exc
                out.append(failed)
        return out

    def generate_streaming(self, req: GenerateRequest, on_token, cancelled=None) -> Completion:
        """One request, ``on_token(id)`` called as the engine samples each token; ``cancelled`` (an ``Event``)
        aborts it."""
        future = self.engine.submit(req, on_token)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not future.done():
            if cancelled is not None and cancelled.is_set():
                self.engine.abort(future)
            if deadline is not None and time.monotonic() > deadline:
                raise EngineUnavailable(f"completion 0: not done after {self.timeout} s")
            try:
                self.engine.wait([future], 0.05)  # a few steps here (or by the loop), then look at cancelled again
            except TimeoutError:
                pass
        try:
            return validate_completion(future.result(), req, self.vocab_size, 0, self.routing_shape)
        except RequestError:
            raise
        except EngineError as exc:
            raise EngineUnavailable(f"completion 0: {exc}") from exc

    def stop(self, requests: list[GenerateRequest]) -> None:
        """End these requests (by their ``rid``) now, each answered with the tokens it has (``Engine.stop``)."""
        for req in requests:
            if req.rid is not None:
                self.engine.stop_request(req.rid)

    def _submit_as_room_allows(self, requests: list[GenerateRequest], on_done=None) -> list[Future]:
        """Every request's future, each submitted once the engine's queue has room for it; returns
        when all are done. What others queued meanwhile shares the room (a full queue still answers 503)."""
        engine, futures, sent = self.engine, [], 0
        while sent < len(requests):
            room = engine.limits.max_queue - engine.num_waiting
            if room > 0:
                batch = requests[sent : sent + room]
                submitted = engine.submit_all(batch)  # admitted together: a group shares its prompt's prefill
                if on_done is not None:
                    for i, future in enumerate(submitted, start=sent):
                        future.add_done_callback(lambda f, i=i: on_done(i, ended_finished(f)))
                futures += submitted
                sent += len(batch)
                continue
            mine = [f for f in futures if not f.done()]
            if mine:
                engine.wait(mine, self.timeout, any_done=True)
            else:  # others' requests fill the queue: their callers step the engine
                time.sleep(0.01)
        engine.wait(futures, self.timeout)
        return futures
