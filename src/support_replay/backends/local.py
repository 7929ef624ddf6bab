"""The in-process engine as a backend (colocated rollouts, tests)."""

from __future__ import annotations

from ..engine import Engine
from ..errors import EngineError, EngineUnavailable, RequestError
from ..protocol import GenerateRequest, validate_completion


class EngineBackend:
    retries = 0  # in-process: nothing to send again

    def __init__(self, engine: Engine, timeout: float | None = None):
        self.engine = engine.start()
        self.vocab_size = engine.vocab_size
        self.timeout = timeout

    def generate(self, requests: list[GenerateRequest], *, return_exceptions: bool = False) -> list:
        """A refused request raises; one the engine failed or dropped is ``EngineUnavailable``
        (in its place with ``return_exceptions``)."""
        futures = [self.engine.submit(r) for r in requests]
        out = []
        for i, (req, future) in enumerate(zip(requests, futures)):
            try:
                out.append(validate_completion(future.result(timeout=self.timeout), req, self.vocab_size, i))
            except RequestError:
                raise
            except EngineError as exc:
                failed = EngineUnavailable(f"completion {i}: {exc}")
                if not return_exceptions:
                    raise failed from exc
                out.append(failed)
        return out
