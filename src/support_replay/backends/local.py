"""The in-process engine as a backend (colocated rollouts, tests)."""

from __future__ import annotations

from ..engine import Engine
from ..errors import EngineError, EngineUnavailable, RequestError
from ..protocol import GenerateRequest, validate_completion


class EngineBackend:
    retries = 0  # in-process: nothing to send again

    def __init__(self, engine: Engine, timeout: float | None = None):
        self.engine = engine  # not started: generate runs its steps in the calling thread (Engine.wait)
        self.vocab_size = engine.vocab_size
        self.timeout = timeout

    def generate(self, requests: list[GenerateRequest], *, return_exceptions: bool = False) -> list:
        """A refused request raises; one the engine failed or dropped is ``EngineUnavailable``
        (in its place with ``return_exceptions``)."""
        futures = self.engine.submit_all(requests)  # admitted together: a group shares its prompt's prefill
        self.engine.wait(futures, self.timeout)
        out = []
        for i, (req, future) in enumerate(zip(requests, futures)):
            try:
                out.append(validate_completion(future.result(), req, self.vocab_size, i))
            except RequestError:
                raise
            except EngineError as exc:
                failed = EngineUnavailable(f"completion {i}: {exc}")
                if not return_exceptions:
                    raise failed from exc
                out.append(failed)
        return out
