"""Does the built-in demo learn? `support-replay train` (the `make run` defaults) on several seeds.

    python bench/demo.py [--seeds 0,1,2] [--out runs/demo-seeds] [--plot docs/demo_curves.png]
    python bench/demo.py --read runs/demo-seeds            # tables from runs already made

Each seed runs the default job in a process of its own (`--seed N`, which also picks the task's
questions) and is timed whole, model loading included. Prints the reward per update of every
seed, the mean reward of the first and the last quarter of the updates, and the wall time; then
what the README quotes of faithfulness: a full-vocabulary scorer's mean ratio pi/mu and its share of
tokens outside [0.9, 1.1] over the first four updates (before the policy sharpens), the replayed
ratio and the largest per-token |log pi - log mu| over all updates. With ``--plot`` saves the curves
(matplotlib).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "support_replay.cli",
            "train",
            "--seed",
            str(seed),
            "--output-dir",
            str(out),
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rewards(out: Path) -> list[float]:
    return [row["reward_mean"] for row in rows(out)]


def faithfulness(out: Path, first: int = 4) -> str:
    """A table row: the full-vocabulary ratio's range over the first updates, the replayed ratio's range and the
    largest per-token difference over all of them."""
    every = rows(out)
    early = [r for r in every[:first] if "full_vocab_ratio_mean" in r]
    span = lambda values, fmt: f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"  # noqa: E731
    full = span([r["full_vocab_ratio_mean"] for r in early], ".2f")
    outside = span([100 * r["full_vocab_ratio_outside_10pct"] for r in early], ".0f")
    replay = span([r["replay_ratio_mean"] for r in every], ".4f")
    worst = max(r["train_rollout_logprob_abs_diff_max"] for r in every)
    return f"{full} | {outside}% | {replay} | {worst:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="runs/demo-seeds", help="one sub-directory per seed")
    ap.add_argument("--read", help="only read the runs under this directory (seed_N sub-directories)")
    ap.add_argument("--plot", help="save the reward curves to this PNG")
    args = ap.parse_args()
    root = Path(args.read or args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    walls = {s: None if args.read else run_seed(s, root / f"seed_{s}") for s in seeds}
    curves = {s: rewards(root / f"seed_{s}") for s in seeds}
    steps = max(len(c) for c in curves.values())
    print("| update | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---:|" + "---:|" * len(seeds))
    for i in range(steps):
        print(f"| {i} | " + " | ".join(f"{curves[s][i]:.3f}" if i < len(curves[s]) else "" for s in seeds) + " |")
    print("\n| seed | first quarter mean reward | last quarter mean reward | rises | wall s |")
    print("|---:|---:|---:|---|---:|")
    for s in seeds:
        c = curves[s]
        q = max(len(c) // 4, 1)
        first, last = sum(c[:q]) / q, sum(c[-q:]) / q
        wall = f"{walls[s]:.0f}" if walls[s] is not None else ""
        print(f"| {s} | {first:.3f} | {last:.3f} | {'yes' if last > first else 'no'} | {wall} |")
    print(
        "\n| seed | full vocab: mean ratio, updates 0-3 | outside [0.9, 1.1] | replay: mean ratio, all updates | "
        "max abs(log pi - log mu), all updates |"
    )
    print("|---:|---:|---:|---:|---:|")
    for s in seeds:
        print(f"| {s} | {faithfulness(root / f'seed_{s}')} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for s in seeds:
            ax.plot(range(len(curves[s])), curves[s], marker="o", markersize=3, label=f"seed {s}")
        ax.set_xlabel("update")
        ax.set_ylabel("mean reward")
        ax.set_ylim(0, 1)
        ax.set_title("support-replay train (defaults): SmolLM2-135M, arithmetic")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
