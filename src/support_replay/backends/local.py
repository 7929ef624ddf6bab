"""The in-process engine as a backend (colocated rollouts, tests)."""

from __future__ import annotations

import numpy as np

from ..engine import Engine, GenerateRequest
from .base import Completion, validate_completion


class EngineBackend:
    def __init__(self, engine: Engine, timeout: float | None = None):
        self.engine = engine.start()
        self.vocab_size = engine.vocab_size
        self.timeout = timeout

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        out = []
        for i, (req, res) in enumerate(zip(requests, self.engine.generate(requests, timeout=self.timeout))):
            completion = Completion(
                output_ids=res.output_ids,
                logprobs=None if res.logprobs is None else np.asarray(res.logprobs, np.float32),
                support=res.support,
                full_logprobs=None if res.full_logprobs is None else np.asarray(res.full_logprobs, np.float32),
                finish_reason=res.finish_reason,
                text=res.text,
                weight_version=res.weight_version,
            )
            out.append(validate_completion(completion, req, self.vocab_size, i))
        return out
