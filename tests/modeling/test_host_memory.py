"""Freed host memory kept for reuse (modeling/host_memory.py): glibc's settings asked once, in a fresh
process so the suite's own allocator is not the one under test; the opt-out and a bad value."""

import subprocess
import sys

import pytest

from support_replay.errors import ConfigError
from support_replay.modeling import host_memory

PROBE = """
import ctypes, sys, time
from support_replay.modeling.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is True
def faults():
    return int(open("/proc/self/stat").read().split(")")[1].split()[7])  # minflt
import torch
torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # a first 64 MiB tensor, freed
before = faults()
for _ in range(3):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # made again: fresh pages, or the freed ones
print(faults() - before)
"""


def minor_faults(mode: str) -> int:
    env = {"SUPPORT_REPLAY_MALLOC": "system"} if mode == "system" else {}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env={**_env(), **env}
    )
    return int(out.stdout.split()[-1])


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "SUPPORT_REPLAY_MALLOC"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_tensor_made_again_reuses_freed_memory_instead_of_faulting_in_fresh_pages():
    pages = (64 << 20) // 4096
    assert minor_faults("system") >= 2 * pages  # glibc's defaults: every 64 MiB tensor is new mapped pages
    assert minor_faults("keep") < pages // 4  # kept: the freed memory serves the next one


def test_the_opt_out_and_a_bad_value(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "system")
    assert host_memory.keep_freed_memory() is False
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("SUPPORT_REPLAY_MALLOC", "tcmalloc")
    with pytest.raises(ConfigError, match="SUPPORT_REPLAY_MALLOC='tcmalloc'"):
        host_memory.keep_freed_memory()
    host_memory.keep_freed_memory.cache_clear()
