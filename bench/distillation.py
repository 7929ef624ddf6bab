"""On-policy distillation on SmolLM2: reward per update with RL alone, distillation alone and both, one sitting,
and the exact on-support divergence beside the one-sample estimate on the same tokens.

    python bench/distillation.py [--updates 10] [--teacher DIR]

The teacher is what ``support-replay train`` produces with its defaults (GRPO on SmolLM2-135M-Instruct, 20
updates, the built-in arithmetic task), saved with ``--save``; ``--teacher DIR`` reuses one. The student starts
from SmolLM2-135M-Instruct each time, with the defaults' rollouts (8 prompts x 4 samples, top_p 0.8, top_k 32)
and the same seed:

- ``rl``: GRPO alone (the defaults);
- ``opd``: ``--use-opd --opd-only``: the exact reverse KL on each token's support, no reward in the loss;
- ``rl+opd``: GRPO plus ``--use-opd`` (``--opd-kl-coef 1``);
- ``rl+single``: GRPO plus slime's one-sample advantage shaping (``--opd-estimator single``).

Printed: the mean reward of each update (the rollout's samples, before the update), and for the distillation
runs the per-token exact divergence and one-sample estimate (means and variances over the run's trained tokens),
the estimate's bias (their difference), the teacher's mass inside S_t and the agreement on S_t's most likely id.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.train import train
from support_replay.train.config import RunConfig

RUNS = {
    "rl": {},
    "opd": dict(use_opd=True, opd_only=True),
    "rl+opd": dict(use_opd=True),
    "rl+single": dict(use_opd=True, opd_estimator="single"),
}


def teacher(out: Path) -> tuple[Path, list[float]]:
    """``support-replay train`` with its defaults, saved at its last update."""
    rows = train(RunConfig(output_dir=str(out / "teacher-run"), save=str(out / "teacher"), save_interval=20))
    saved = sorted((out / "teacher").glob("rollout_*"))[-1]
    return saved, [r["reward_mean"] for r in rows]


def student(name: str, updates: int, teacher_dir: Path, out: Path) -> tuple[list[dict], float]:
    extra = dict(RUNS[name])
    if extra:
        extra["opd_teacher_load"] = str(teacher_dir)
    t0 = time.perf_counter()
    rows = train(RunConfig(num_rollout=updates, output_dir=str(out / name), progress=False, **extra))
    return rows, time.perf_counter() - t0


def weighted(rows: list[dict], key: str) -> float:
    """A per-token mean over the run: each rollout's mean weighted by its trained tokens."""
    tokens = [r["response_len_mean"] * r["samples"] for r in rows]
    return sum(r[key] * n for r, n in zip(rows, tokens)) / sum(tokens)


def pooled_var(rows: list[dict], mean_key: str, var_key: str) -> float:
    """The variance per token over the whole run, from each rollout's mean and variance."""
    mean = weighted(rows, mean_key)
    tokens = [r["response_len_mean"] * r["samples"] for r in rows]
    second = sum((r[var_key] + r[mean_key] ** 2) * n for r, n in zip(rows, tokens)) / sum(tokens)
    return second - mean * mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--teacher", help="a saved checkpoint to use as the teacher (default: train one)")
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-opd-"))
    print(f"CPU: {cpu_identity()}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct fp32, in process")
    if args.teacher:
        teacher_dir, teacher_rewards = Path(args.teacher), []
    else:
        t0 = time.perf_counter()
        teacher_dir, teacher_rewards = teacher(out)
        print(f"teacher: support-replay train (defaults) in {time.perf_counter() - t0:.0f} s, saved {teacher_dir}")
        print(f"teacher's reward in its last 5 updates: {statistics.mean(teacher_rewards[-5:]):.3f}\n")
    results = {}
    for name in args.runs.split(","):
        results[name] = student(name, args.updates, teacher_dir, out)
    names = list(results)
    print("| update | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for u in range(args.updates):
        print(f"| {u} | " + " | ".join(f"{results[n][0][u]['reward_mean']:.3f}" for n in names) + " |")
    print(
        "| mean of the last 5 | "
        + " | ".join(f"{statistics.mean(r['reward_mean'] for r in results[n][0][-5:]):.3f}" for n in names)
        + " |"
    )
    print("| wall s | " + " | ".join(f"{results[n][1]:.0f}" for n in names) + " |\n")
    print(
        "| run | exact divergence (mean / var per token) | one-sample estimate (mean / var) | estimate - exact "
        "| teacher's mass in S_t | agreement on S_t |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        rows = results[n][0]
        if "opd_divergence" not in rows[0]:
            continue
        exact_var = pooled_var(rows, "opd_divergence", "opd_divergence_var")
        single_var = pooled_var(rows, "opd_single_estimate", "opd_single_var")
        print(
            f"| {n} | {weighted(rows, 'opd_divergence'):.3f} / {exact_var:.3f} "
            f"| {weighted(rows, 'opd_single_estimate'):.3f} / {single_var:.3f} "
            f"| {weighted(rows, 'opd_single_bias'):+.4f} | {weighted(rows, 'opd_teacher_mass'):.3f} "
            f"| {weighted(rows, 'opd_agreement'):.3f} |"
        )


if __name__ == "__main__":
    main()
