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
def heap_mib():
    lines = open("/proc/self/maps").read().splitlines()
    spans = [line.split()[0].split("-") for line in lines if line.endswith("[heap]")]
    return sum(int(b, 16) - int(a, 16) for a, b in spans) >> 20
before = heap_mib()
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
during = heap_mib()
del t
print(during - before, heap_mib() - before)
"""


def heap_growth(malloc: str) -> tuple[str, int, int]:
    env = {k: v for k, v in os.environ.items() if k != "SUPPORT_REPLAY_MALLOC"} | {"SUPPORT_REPLAY_MALLOC": malloc}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    applied, growth = out.stdout.split("\n")[:2]
    during, after = map(int, growth.split())
    return applied, during, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/maps")
@pytest.mark.processes
def test_a_large_tensor_comes_from_the_heap_and_its_memory_stays_for_the_next():
    applied, during, after = heap_growth("keep")
    assert applied == "True" and during >= 64 and after >= 64  # served by the heap, kept when freed
    applied, during, after = heap_growth("system")
    assert applied == "False" and during < 64  # glibc's defaults: a mapping of its own, unmapped when freed


def test_the_opt_out_and_a_bad_value(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "system")
    assert host_memory.keep_freed_memory() is False
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "tcmalloc")
    with pytest.raises(ConfigError, match="SUPPORT_REPLAY_MALLOC='tcmalloc'"):
        host_memory.keep_freed_memory()
    host_memory.keep_freed_memory.cache_clear()
