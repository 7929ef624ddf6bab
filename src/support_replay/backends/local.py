"""The in-process engine as a backend (colocated rollouts, tests)."""

from __future__ import annotations

from ..engine import Engine
from ..protocol import Completion, GenerateRequest, validate_completion


class EngineBackend:
    def __init__(self, engine: Engine, timeout: float | None = None):
        self.engine = engine.start()
        self.vocab_size = engine.vocab_size
        self.timeout = timeout

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        completions = self.engine.generate(requests, timeout=self.timeout)
        return [validate_completion(c, req, self.vocab_size, i) for i, (req, c) in enumerate(zip(requests, completions))]
