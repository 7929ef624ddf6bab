"""The GRPO step's update against its FLOP bound on this machine: what the products need, what they take.

    python bench/update_bound.py [--rollouts 4] [--dtype bfloat16]

The same work as bench/e2e.py (SmolLM2-135M-Instruct, 4 prompts x 4 samples, up to 64 new tokens, one
optimizer step per rollout, replay and --ci-test on). Two runs of the same seeds, which sample the same
rollouts: the first counts the floating-point operations of every update (``torch.utils.flop_counter``,
forward and backward, oneDNN's forward products included), the second times the update and its parts
(the loss's forward, the backward, clipping and the optimizer step) with nothing counting. The peak is
this machine's own: the fastest of the products it offers (MKL through ``torch.mm``, oneDNN's) on a large
square and on the update's own shapes, at the run's thread count. The bound is the update's FLOPs at that
peak; the gap is what the update takes beyond it. The first rollout is a warm-up, left out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from e2e import run_config
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.train import train
from support_replay.train.actor import Actor
from support_replay.train.config import RunConfig
from support_replay.train.learner import Learner
from support_replay.train.scorer import Scorer
from timing import seconds_per_call


@register_flop_formula(torch.ops.mkldnn._linear_pointwise)
def _onednn_linear_flops(x_shape, w_shape, *args, **kwargs) -> int:
    """oneDNN's forward product, ``x [..., in] @ w.T``; a packed weight is not a plain shape and is not used here."""
    rows = 1
    for n in x_shape[:-1]:
        rows *= n
    return 2 * rows * x_shape[-1] * w_shape[0]


def config(rollouts: int, dtype: str) -> RunConfig:
    return run_config(rollouts, 8, dtype=dtype)  # bench/e2e.py's work and settings


class Clocks:
    """Seconds per rollout of the update and of its parts, by wrapping the methods that run them."""

    def __init__(self):
        self.rows: list[dict] = []
        self._inside = False
        self._restore = []

    def wrap(self, owner, name: str, key: str, opens: bool = False) -> None:
        fn = getattr(owner, name)
        clocks = self

        def timed(*args, **kwargs):
            if not (opens or clocks._inside):
                return fn(*args, **kwargs)
            if opens:
                clocks.rows.append(defaultdict(float))
                clocks._inside = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clocks.rows[-1][key] += time.perf_counter() - start
                if opens:
                    clocks._inside = False

        setattr(owner, name, timed)
        self._restore.append((owner, name, fn))

    def close(self) -> None:
        for owner, name, fn in reversed(self._restore):
            setattr(owner, name, fn)


def counted_run(rollouts: int, dtype: str) -> list[int]:
    """FLOPs of every rollout's update."""
    flops, real = [], Learner.update

    def update(self, *args, **kwargs):
        with FlopCounterMode(display=False) as counter:
            out = real(self, *args, **kwargs)
        flops.append(counter.get_total_flops())
        return out

    Learner.update = update
    try:
        train(config(rollouts, dtype))
    finally:
        Learner.update = real
    return flops


def timed_run(rollouts: int, dtype: str) -> tuple[list[dict], list[dict]]:
    clocks = Clocks()
    clocks.wrap(Learner, "update", "update", opens=True)
    clocks.wrap(Scorer, "__call__", "forward")
    clocks.wrap(Actor, "backward", "backward")
    clocks.wrap(Actor, "clip_and_step", "clip and optimizer step")
    try:
        rows = train(config(rollouts, dtype))
    finally:
        clocks.close()
    return rows, clocks.rows


def peak_gflops(dtype: torch.dtype, shapes: list[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of the fastest of MKL's and oneDNN's products at each ``(rows, in, out)`` shape (median of runs)."""
    out = {}
    for rows, n_in, n_out in shapes:
        x, w = torch.randn(rows, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
        kernels = {"torch.mm": lambda: torch.mm(x, w.t())}
        if torch.backends.mkldnn.is_available():
            kernels["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
        best = 0.0
        for fn in kernels.values():
            best = max(best, 2 * rows * n_in * n_out / seconds_per_call(fn, repeats) / 1e9)
        out[f"{rows}x{n_in} @ {n_in}x{n_out}"] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_identity()}, {args.dtype}")

    flops = counted_run(args.rollouts, args.dtype)
    rows, parts = timed_run(args.rollouts, args.dtype)
    # the update's own shapes: a micro-batch of 8 samples packed is a few hundred tokens
    shapes = [(2048, 2048, 2048), (512, 576, 1536), (512, 1536, 576), (512, 576, 49152)]
    peaks = peak_gflops(dtype, shapes)
    peak = max(peaks.values())
    print("\n| product (rows x in @ in x out) | GFLOP/s, fastest kernel |")
    print("|---|---:|")
    for shape, g in peaks.items():
        print(f"| {shape} | {g:.1f} |")

    print(
        "\n| rollout | update s | forward s | backward s | clip + optimizer s | other s | update GFLOP | "
        f"bound at {peak:.0f} GFLOP/s s | update / bound |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    steady = []
    for r, (row, part, f) in enumerate(zip(rows, parts, flops)):
        other = part["update"] - part["forward"] - part["backward"] - part["clip and optimizer step"]
        bound = f / (peak * 1e9)
        print(
            f"| {r} | {part['update']:.2f} | {part['forward']:.2f} | {part['backward']:.2f} | "
            f"{part['clip and optimizer step']:.2f} | {other:.2f} | {f / 1e9:.1f} | {bound:.2f} | "
            f"{part['update'] / bound:.2f}x |"
        )
        if r:
            steady.append((part, f, row))
    if steady:
        mean = {k: statistics.mean(p[k] for p, _, _ in steady) for k in steady[0][0]}
        f = statistics.mean(f for _, f, _ in steady)
        print(
            f"\nsteps 1+: update {mean['update']:.2f} s for {f / 1e9:.1f} GFLOP: "
            f"{f / mean['update'] / 1e9:.1f} GFLOP/s achieved, "
            f"{100 * f / mean['update'] / 1e9 / peak:.0f}% of the measured peak; "
            f"response length {statistics.mean(r['response_len_mean'] for _, _, r in steady):.1f}"
        )


if __name__ == "__main__":
    main()
