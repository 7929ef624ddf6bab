"""Does the built-in demo learn? `support-replay train` (the `make run` defaults) on several seeds.

    python bench/demo.py [--seeds 0,1,2] [--out runs/demo-seeds] [--plot docs/demo_curves.png]
    python bench/demo.py --read runs/demo-seeds            # tables from runs already made

Each seed runs the default job in a process of its own (`--seed N`, which also picks the task's
questions) and is timed whole, model loading included. Prints the reward per update of every
seed, the mean reward of the first and the last quarter of the updates, and the wall time; with
``--plot`` saves the curves (matplotlib).
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


def rewards(out: Path) -> list[float]:
    return [
        json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]


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
