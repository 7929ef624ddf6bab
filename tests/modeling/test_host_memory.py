"""Freed host memory kept for reuse (modeling/host_memory.py): in a fresh process (the suite's own
allocator is not the one under test), a large tensor comes from glibc's heap instead of a mapping of its
own and the heap keeps it once freed; glibc's defaults map it apart; the opt-out and a bad value."""

import os
import subprocess
import sys

import pytest

from support_replay.errors import ConfigError
from support_replay.modeling import host_memory

PROBE = """
import sys
from support_replay.modeling.host_memory import keep_freed_memory
print(keep_freed_memory())
import torch
def heap():
    lines = open("/proc/self/maps").read().splitlines()
    return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in lines if line.endswith("[heap]")]
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
inside = any(a <= t.data_ptr() and t.data_ptr() + t.numel() <= b for a, b in heap())
del t
print(inside, sum(b - a for a, b in heap()) >> 20)
"""


def on_the_heap(malloc: str) -> tuple[str, bool, int]:
    """``(applied, the tensor lay inside the heap, the heap's MiB once it was freed)`` in a fresh process. (The
    heap's growth was measured before: a heap with free room left by what the process did first grew 63 MiB for
    the 64 MiB tensor, and the test failed where nothing was wrong.)"""
    env = {k: v for k, v in os.environ.items() if k != "SUPPORT_REPLAY_MALLOC"} | {"SUPPORT_REPLAY_MALLOC": malloc}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    applied, where = out.stdout.split("\n")[:2]
    inside, heap_after = where.split()
    return applied, inside == "True", int(heap_after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/maps")
@pytest.mark.processes
def test_a_large_tensor_comes_from_the_heap_and_its_memory_stays_for_the_next():
    applied, inside, heap_after = on_the_heap("keep")
    assert applied == "True" and inside and heap_after >= 64  # served by the heap, kept when freed
    applied, inside, heap_after = on_the_heap("system")
    assert applied == "False" and not inside  # glibc's defaults: a mapping of its own (unmapped when freed)


def test_the_opt_out_and_a_bad_value(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "system")
    assert host_memory.keep_freed_memory() is False
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "tcmalloc")
    with pytest.raises(ConfigError, match="SUPPORT_REPLAY_MALLOC='tcmalloc'"):
        host_memory.keep_freed_memory()
    host_memory.keep_freed_memory.cache_clear()
