"""SGLang's ``--decode-log-interval``: every N decode steps, one line of what the engine is doing.

The line has SGLang's fields (its scheduler's metrics reporter, read from the 0.5.23 wheel): running
requests, KV positions in use, their share of the budget, the generation throughput since the last
line, and the requests waiting. Here the positions in use are each running row's prompt and output
so far; the budget is ``--max-total-tokens`` (engine/kv_budget.py). Interval 0 logs nothing.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("support_replay.engine")


class DecodeLog:
    def __init__(self, interval: int = 0):
        if interval < 0:
            raise ValueError(f"decode_log_interval: must be >= 0, got {interval}")
        self.interval = interval
        self.steps = 0
        self.generated = 0
        self.since = time.perf_counter()

    def step(self, running: int, tokens: int, budget: int, queued: int) -> str | None:
        """Count one decode step of ``running`` rows; every ``interval`` steps, log the line and return it."""
        if not self.interval:
            return None
        self.steps += 1
        self.generated += running
        if self.steps % self.interval:
            return None
        now = time.perf_counter()
        throughput = self.generated / max(now - self.since, 1e-9)
        self.since, self.generated = now, 0
        line = (
            f"Decode batch, #running-req: {running}, #token: {tokens}, token usage: {tokens / max(budget, 1):.2f}, "
            f"gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}"
        )
        log.info(line)
        return line
