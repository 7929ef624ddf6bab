"""What ``--linear-kernel auto`` measures and picks on this machine, as it is and with the ISA capped at AVX2
(``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``, a stand-in for an older CPU).

Each probe runs in a process of its own with an empty cache (modeling/kernel_probe.py: MKL's ``F.linear`` against
oneDNN's packed product, 16 rows, three layer shapes, medians of alternating rounds; and the trainer's forward and
backward at 512 rows on each), --repeats times, and the table shows every measurement and both choices. Beside
them, in the same process after the probe, MKL's own packed GEMM (``torch.ops.mkl._mkl_linear`` over
``_mkl_reorder_linear_weight``, what PyTorch's compiler emits for fp32 linear layers): a candidate ``auto`` does not
offer, timed so that a CPU where it would win shows it, with whether it keeps ``F.linear``'s bits at those rows.

    python bench/kernel_probe.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CODE = (
    "import json, sys; sys.path.insert(0, {bench!r}); from kernel_probe import mkl_packed; "
    "from support_replay.modeling.kernel_probe import probe_record, cpu_identity; "
    "print(json.dumps({{**probe_record(), **mkl_packed(), 'cpu': cpu_identity()}}))"
)


def mkl_packed() -> dict:
    """MKL's packed GEMM at the probe's rows and shapes: ``{"mkl_packed_ms", "mkl_packed_bits"}`` (None where
    this PyTorch has no such op); the bits: equal to ``F.linear``'s on every shape."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    from support_replay.modeling.kernel_probe import CALLS, ROUNDS, ROWS, SHAPES

    op = getattr(torch.ops.mkl, "_mkl_linear", None)
    if op is None or not hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        return {"mkl_packed_ms": None, "mkl_packed_bits": None}
    gen = torch.Generator().manual_seed(0)
    total, same = 0.0, True
    for out_features, in_features in SHAPES:
        x = torch.randn(ROWS, in_features, generator=gen)
        w = torch.randn(out_features, in_features, generator=gen)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, ROWS)
        same &= torch.equal(op(x, packed, w, None, ROWS), F.linear(x, w))
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(CALLS):
                op(x, packed, w, None, ROWS)
            times.append((time.perf_counter() - start) / CALLS)
        total += 1e3 * statistics.median(times)
    return {"mkl_packed_ms": round(total, 4), "mkl_packed_bits": bool(same)}


def probe(env: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run(
            [sys.executable, "-c", CODE.format(bench=os.path.dirname(os.path.abspath(__file__)))],
            env={**os.environ, **env, "SUPPORT_REPLAY_CACHE": cache},
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        for name, env in (("as it is", {}), ("AVX2 caps", AVX2)):
            rows.append((name, probe(env)))
    print(f"\n{rows[0][1]['cpu']}, {rows[0][1]['threads']} threads")
    print(
        "| ISA | MKL F.linear ms | oneDNN packed ms | oneDNN / MKL | auto picks | MKL packed ms (not offered) | "
        "its bits = F.linear's | trainer: MKL ms | trainer: oneDNN ms | trainer: oneDNN / MKL | trainer's auto |"
    )
    print("|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|")
    for name, r in rows:
        packed = "n/a" if r["mkl_packed_ms"] is None else f"{r['mkl_packed_ms']:.3f}"
        print(
            f"| {name} | {r['torch_ms']:.3f} | {r['onednn_ms']:.3f} | {r['onednn_ms'] / r['torch_ms']:.2f} "
            f"| {r['choice']} | {packed} | {r['mkl_packed_bits']} | {r['train_torch_ms']:.1f} | "
            f"{r['train_onednn_ms']:.1f} | {r['train_onednn_ms'] / r['train_torch_ms']:.2f} | {r['train_choice']} |"
        )


if __name__ == "__main__":
    main()
