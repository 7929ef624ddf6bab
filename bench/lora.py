"""LoRA against full fine-tuning on `make run`'s task (SmolLM2-135M-Instruct, the built-in arithmetic, 20 GRPO
updates of 8 x 4 with top_p 0.8 / top_k 32, --ci-test): reward per update, peak memory and step time of each,
every run in a process of its own (its peak RSS is its own). Prints a table; --plot draws the reward curves.

    python bench/lora.py [--rollouts 20] [--rank 16] [--lora-lr 1e-4] [--plot docs/lora_curves.png]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(mode: str, rollouts: int, rank: int, lora_lr: float, out: str) -> None:
    """Child process: one run, then its rows, wall time and peak RSS as JSON on the last line."""
    from support_replay.train import train
    from support_replay.train.config import RunConfig

    extra = dict(lora_rank=rank, lora_alpha=2.0 * rank, lr=lora_lr) if mode == "lora" else {}
    cfg = RunConfig(num_rollout=rollouts, ci_test=True, progress=False, output_dir=out, **extra)
    start = time.perf_counter()
    rows = train(cfg)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"rows": rows, "wall": wall, "peak_mib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=1e-4, help="LoRA's learning rate (full fine-tuning: train's)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--one", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.rollouts, args.rank, args.lora_lr, args.out)
    results = {}
    for mode in ("full", "lora"):
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--one", mode, "--out", out, "--rollouts", str(args.rollouts)]
            command += ["--rank", str(args.rank), "--lora-lr", str(args.lora_lr)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        "| run | trained params | peak RSS MiB | step s (mean) | update s (mean) | reward first 5 | reward last 5 | "
        "max abs(dlogp) |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for mode, r in results.items():
        rows = r["rows"]
        mean = lambda key, part=rows: sum(x[key] for x in part) / len(part)  # noqa: E731
        trained = f"LoRA rank {args.rank} (lr {args.lora_lr:g})" if mode == "lora" else "all (lr 2e-5)"
        print(
            f"| {mode} | {trained} | {r['peak_mib']:.0f} | {mean('time_step'):.2f} | {mean('time_update'):.2f} | "
            f"{mean('reward_mean', rows[:5]):.3f} | {mean('reward_mean', rows[-5:]):.3f} | "
            f"{max(x['train_rollout_logprob_abs_diff_max'] for x in rows):.2e} |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for mode, r in results.items():
            ax.plot([x["rollout"] for x in r["rows"]], [x["reward_mean"] for x in r["rows"]], marker="o", label=mode)
        ax.set_xlabel("update")
        ax.set_ylabel("mean reward")
        ax.set_title(f"SmolLM2-135M, arithmetic: full fine-tuning vs LoRA rank {args.rank}")
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
