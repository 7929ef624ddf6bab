"""The bench scripts' call timer: wall seconds of one call, over repeated calls after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def seconds_per_call(
    fn: Callable[[], object], repeats: int, warmup: int = 1, pick: Callable[[list[float]], float] = statistics.median
) -> float:
    """``pick`` (the median, or ``min``: the best) of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)
