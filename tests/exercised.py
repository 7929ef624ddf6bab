"""What a test run exercised, for the end of its report (tests/conftest.py): the CPU, the ISA ATen took and the caps
set on it, the kernels built, the product each mode ran, and the versions of the real engines and routers that ran.
A fixture that starts a real engine notes it here (``ran``)."""

from __future__ import annotations

import importlib.metadata
import os

import torch

RAN: dict[str, str] = {}  # engine or router -> its version, noted by the fixtures that started one
CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def ran(name: str, version: str) -> None:
    RAN[name] = version


def _cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in FLAGS if flag in present]
    except OSError:
        pass
    return []


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def exercised_lines() -> list[str]:
    from support_replay.kernels import build, invariant
    from support_replay.modeling.linear_kernels import onednn_available

    caps = ", ".join(f"{k}={os.environ[k]}" for k in CAPS if k in os.environ) or "none"
    lines = [
        f"CPU: {build.cpu_name()} ({' '.join(_cpu_flags())}), {torch.get_num_threads()} threads",
        f"ATen: torch {torch.__version__}, ISA {torch.backends.cpu.get_cpu_capability()}, caps: {caps}",
    ]
    module, why = build.built()
    lines.append(f"kernels: {module.__name__ if module is not None else 'NOT BUILT: ' + why}")
    if module is not None:
        lines.append(f"true-on-policy products: the invariant arithmetic ({invariant.identity()})")
    if onednn_available():
        from support_replay.modeling.kernel_probe import probe_record

        record = probe_record()
        lines.append(
            f"normal-mode products (--linear-kernel auto): decode {record['choice']}, train {record['train_choice']}"
        )
    for package in ("sglang-router", "smg", "ray"):
        version = _version(package)
        if version:
            lines.append(f"{package}: {version}")
    for name, version in sorted(RAN.items()):
        lines.append(f"ran: {name} {version}")
    return lines
