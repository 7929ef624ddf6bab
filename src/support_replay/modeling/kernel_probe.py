"""Which fp32 product ``--linear-kernel auto`` takes on this machine: measured once, kept, never assumed.

Which product is faster depends on the CPU (oneDNN's packed product took 0.65x MKL's time at decode sizes on an
AMD EPYC; on an Intel Xeon with AMX MKL's path did better) and on the rows of the product. The candidates are the
two ``auto`` chooses between: MKL through ``F.linear`` (``torch``) and oneDNN's product (``onednn``). Two uses are
measured, each on the layer shapes of a small model, alternating, the median of several rounds:

- ``decode``, the engine's: a decode step's 16 rows, oneDNN over weights packed once (what the engine's decode
  step runs, modeling/packed_weights.py);
- ``train``, the trainer's forward outside true-on-policy mode: ``TRAIN_ROWS`` rows, forward and backward through
  each side's autograd (``F.linear``'s, and linear_kernels' oneDNN forward with plain backward products). On a Zen 3
  EPYC oneDNN's forward took 1.16-1.22x MKL's time at 2200 rows of SmolLM2's layer shapes, and a GRPO step's update
  0.4 s more (docs/benchmarks.md), where at 16 rows it takes half of MKL's time.

oneDNN is taken when it needs at most ``MARGIN`` of MKL's time (a near tie keeps PyTorch's default). Bits are not
the question here: true-on-policy mode runs neither product (kernels/invariant.py), and where a packed product
is used its bits are probed there (packed_weights.py).

The answer is kept in the user cache under everything that can change it: the CPU's model and flags,
PyTorch's version, and the ISA caps torch, MKL and oneDNN read from the environment. So every process of a run
on one machine (engine, trainer ranks, a later run) resolves ``auto`` alike; a lock makes the first process's
measurement everyone's.
``SUPPORT_REPLAY_AUTO_KERNEL=torch|onednn`` pins it instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MARGIN = 0.95  # oneDNN must take at most this share of MKL's time
ROWS = 16
SHAPES = ((1024, 1024), (4096, 1024), (1024, 4096))  # (out, in): attention, MLP up and down of a small model
ROUNDS, CALLS = 5, 10
TRAIN_ROWS, TRAIN_ROUNDS = 512, 3  # the trainer's products: a micro-batch's tokens, forward and backward
USES = ("decode", "train")
ENV_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
PIN = "SUPPORT_REPLAY_AUTO_KERNEL"


def cpu_identity() -> str:
    """The CPU's model name and a digest of its flags (/proc/cpuinfo), or the platform's processor string."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return f"{model} [{hashlib.sha1(fields.get('flags', '').encode()).hexdigest()[:12]}]"


def probe_key() -> str:
    caps = ",".join(f"{k}={os.environ.get(k, '')}" for k in ENV_CAPS)
    return f"{cpu_identity()} | torch {torch.__version__} | {caps}"


def measure() -> dict:
    """Milliseconds of MKL's and oneDNN's packed fp32 products at ``ROWS`` rows over ``SHAPES`` (medians, summed)."""
    from .packed_weights import pack_weight, packed_linear

    gen = torch.Generator().manual_seed(0)
    totals = {"torch": 0.0, "onednn": 0.0}
    for out_features, in_features in SHAPES:
        x = torch.randn(ROWS, in_features, generator=gen)
        w = torch.randn(out_features, in_features, generator=gen)
        packed = pack_weight(w)
        runs = {"torch": lambda: F.linear(x, w), "onednn": lambda: packed_linear(x, packed)}
        times = {name: [] for name in runs}
        for fn in runs.values():
            fn()  # first calls pick their kernels
        for _ in range(ROUNDS):
            for name, fn in runs.items():  # alternating: the machine's drift falls on both
                start = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                times[name].append((time.perf_counter() - start) / CALLS)
        for name in runs:
            totals[name] += 1e3 * statistics.median(times[name])
    return totals


def measure_training() -> dict:
    """Milliseconds of a trainer's forward and backward at ``TRAIN_ROWS`` rows over ``SHAPES`` on MKL's and on
    oneDNN's forward (medians, summed)."""
    from .linear_kernels import onednn_linear

    gen = torch.Generator().manual_seed(1)
    totals = {"torch": 0.0, "onednn": 0.0}
    for out_features, in_features in SHAPES:
        x = torch.randn(TRAIN_ROWS, in_features, generator=gen).requires_grad_()
        w = torch.randn(out_features, in_features, generator=gen).requires_grad_()
        grad = torch.randn(TRAIN_ROWS, out_features, generator=gen)

        def step(linear):
            x.grad = w.grad = None
            linear(x, w, None).backward(grad)

        runs = {"torch": lambda: step(F.linear), "onednn": lambda: step(onednn_linear)}
        times = {name: [] for name in runs}
        for fn in runs.values():
            fn()
        for _ in range(TRAIN_ROUNDS):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        for name in runs:
            totals[name] += 1e3 * statistics.median(times[name])
    return totals


def _choose(totals: dict) -> str:
    return "onednn" if totals["onednn"] <= MARGIN * totals["torch"] else "torch"


@functools.cache
def probed_kernel(use: str = "decode") -> str:
    """``torch`` or ``onednn``: the faster fp32 product on this machine for ``use`` (``USES``; kept in the user
    cache)."""
    if use not in USES:
        raise ValueError(f"use: {use!r} is not one of {USES}")
    pinned = os.environ.get(PIN)
    if pinned:
        if pinned not in ("torch", "onednn"):
            from ..errors import ConfigError

            raise ConfigError(f"{PIN}={pinned!r}: give torch or onednn")
        return pinned
    record = probe_record()
    return record["choice"] if use == "decode" else record["train_choice"]


def probe_record() -> dict:
    """This machine's measurement: ``{"choice", "torch_ms", "onednn_ms", "threads"}`` for decoding and the same with
    ``train_`` for the trainer (measured once, under a lock; a record from before the trainer's measurement gets
    it added)."""
    from ..user_cache import cache_dir

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path, key = directory / "kernel-probe.json", probe_key()
    with open(directory / "kernel-probe.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process measures; the others read its answer
        kept = _read(path)
        record = dict(kept.get(key, {}))
        if "choice" not in record:
            record.update(_entry("", measure()))
        if "train_choice" not in record:
            record.update(_entry("train_", measure_training()))
        if record != kept.get(key):
            kept[key] = record
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(kept, indent=2) + "\n")
            os.replace(tmp, path)
        return record


def _entry(prefix: str, totals: dict) -> dict:
    return {
        f"{prefix}choice": _choose(totals),
        f"{prefix}torch_ms": round(totals["torch"], 4),
        f"{prefix}onednn_ms": round(totals["onednn"], 4),
        f"{prefix}threads": torch.get_num_threads(),
    }


def _read(path: Path) -> dict:
    try:
        kept = json.loads(path.read_text())
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        return {}
