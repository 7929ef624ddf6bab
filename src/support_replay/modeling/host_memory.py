"""Freed host memory kept for reuse, so the trainer's large tensors do not fault in fresh pages every step.

glibc's ``malloc`` serves a large request with pages of its own ``mmap`` and unmaps them when the tensor is
freed, so a tensor of that size made again at every step (an embedding's gradient, ``[V, H]``: 113 MB for
SmolLM2; a micro-batch's ``[T, V]`` logits and their softmax) comes back as zero pages that the kernel
faults in one 4 KiB page at a time (a zero-filled ``[49152, 576]`` fp32 tensor: 27,649 faults, 35 ms on an
AMD EPYC). ``keep_freed_memory`` asks glibc (``mallopt``)
to serve every request from its heap and never to trim it, so memory a step freed serves the next step
without a fault: what a caching allocator does (PyTorch's on a GPU; vLLM 0.32's CPU workers preload the
tcmalloc they ship, ``vllm/platforms/cpu.py``, "to reduce memory allocation overhead"). Measured on the
GRPO step of bench/e2e.py, 12 rollouts: the update 5.32 -> 4.37 s, peak RSS 4.38 -> 4.90 GB, flat after
the eighth rollout (docs/benchmarks.md).

The price: the process keeps the heap of its largest moment. The KV block pool maps its own memory
(engine/block_pool.py) and still returns it when empty. ``SUPPORT_REPLAY_MALLOC=system`` keeps glibc's
defaults; where the C library is not glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

OPT_OUT = "SUPPORT_REPLAY_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
NEVER_TRIM = 2**31 - 1  # the largest value the parameter's int takes


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: glibc serves every allocation from its heap (no ``mmap`` of its own) and keeps
    what is freed for reuse. True when applied; False with ``SUPPORT_REPLAY_MALLOC=system``, or without
    glibc."""
    choice = os.environ.get(OPT_OUT, "")
    if choice not in ("", "system", "keep"):
        from ..errors import ConfigError

        raise ConfigError(f"{OPT_OUT}={choice!r}: give system (glibc's defaults) or keep (the default)")
    if choice == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = ctypes.CDLL(None).gnu_get_libc_version  # glibc only: another C library's mallopt means other things
    except (OSError, AttributeError):
        return False
    gnu.restype = ctypes.c_char_p
    applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    log.debug("glibc %s keeps freed memory for reuse: %s", gnu().decode(), applied)
    return applied
