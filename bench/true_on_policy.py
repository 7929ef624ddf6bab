"""True-on-policy mode on SmolLM2-135M: what its bitwise equality costs a GRPO step, and that it holds under every
kernel set.

    python bench/true_on_policy.py [--rounds 3] [--steps 4] [--dtype float32 bfloat16]
    python bench/true_on_policy.py --kernel-sets [--steps 3]

The default compares a GRPO step (bench/e2e.py's work: 4 prompts x 4 samples of the arithmetic task, up to 64 new
tokens, top_p 0.8, top_k 32, --ci-test) in the normal mode (vendor products: MKL or oneDNN as ``--linear-kernel
auto`` measured) and in ``--true-on-policy-mode`` (the invariant arithmetic, kernels/invariant.py), in one dtype,
alternating for ``--rounds`` rounds; each run's mean step (the first, a warm-up, left out), medians of the rounds.

``--kernel-sets`` runs ``--true-on-policy-mode --ci-test`` (tolerance 0) in a process of its own under each of
ATen's kernel sets (this CPU's, AVX2 with MKL and oneDNN capped to it, the portable code), float32 and bf16, and
reports the tokens compared and how many differ (always 0: --ci-test would have stopped the run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

from e2e import PHASES, SETTINGS, run_config  # bench/ is on the path of a script run from it
from support_replay.kernels import build
from support_replay.train import train

KERNEL_SETS = {
    "this CPU's": {},
    "AVX2 (MKL, oneDNN capped)": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "portable (ATen default)": {"ATEN_CPU_CAPABILITY": "default"},
}


def one_run(steps: int, dtype: str, true_on_policy: bool) -> list[dict]:
    return train(run_config(steps, 8, true_on_policy=true_on_policy, dtype=dtype))


def means(rows: list[dict]) -> dict[str, float]:
    steady = rows[1:] or rows
    return {k: statistics.mean(r[k] for r in steady) for k in PHASES}


def compare(args) -> None:
    for dtype in args.dtype:
        runs: dict[str, list[dict[str, float]]] = {"normal": [], "true-on-policy": []}
        for _ in range(args.rounds):
            for name in runs:  # alternating: the machine's drift falls on both
                runs[name].append(means(one_run(args.steps, dtype, name == "true-on-policy")))
        medians = {name: {k: statistics.median(m[k] for m in runs[name]) for k in PHASES} for name in runs}
        ratios = [t["time_step"] / n["time_step"] for n, t in zip(runs["normal"], runs["true-on-policy"])]
        print(f"\n{dtype}, medians of {args.rounds} alternating rounds of {args.steps} steps (steps 1+)\n")
        print("| mode | generate s | update s (with its scoring) | step s |")
        print("|---|---:|---:|---:|")
        for name, m in medians.items():
            print(f"| {name} | {m['time_generate']:.2f} | {m['time_update']:.2f} | {m['time_step']:.2f} |")
        print(
            f"\ntrue-on-policy / normal step: {statistics.median(ratios):.2f} (rounds: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + ")"
        )


def check_only(args) -> None:
    """One true-on-policy run (this process's kernel set): a JSON line of what --ci-test compared."""
    rows = one_run(args.steps, args.dtype[0], True)
    print(
        "RESULT "
        + json.dumps(
            {
                "isa": torch.backends.cpu.get_cpu_capability(),
                "tokens": sum(r["train_rollout_compared_tokens"] for r in rows),
                "unequal": sum(r["train_rollout_unequal_tokens"] for r in rows),
                "max_abs": max(r["train_rollout_logprob_abs_diff_max"] for r in rows),
                "step_s": means(rows)["time_step"],
            }
        )
    )


def kernel_sets(args) -> None:
    print("\n| kernel set | ATen ISA | dtype | tokens compared | unequal | max abs(log pi - log mu) | step s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, env in KERNEL_SETS.items():
        for dtype in args.dtype:
            command = [sys.executable, __file__, "--check-only", "--steps", str(args.steps), "--dtype", dtype]
            done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"| {name} | - | {dtype} | FAILED: {done.stderr.strip().splitlines()[-1:]} | | | |")
                continue
            r = json.loads(lines[-1].removeprefix("RESULT "))
            print(
                f"| {name} | {r['isa']} | {dtype} | {r['tokens']} | {r['unequal']} | {r['max_abs']:g} | "
                f"{r['step_s']:.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--kernel-sets", action="store_true", help="--ci-test at tolerance 0 under each kernel set")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)  # kernel_sets' subprocess
    args = ap.parse_args()
    if args.check_only:
        check_only(args)
        return
    print(
        f"{build.cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {datetime.date.today()}; "
        f"{SETTINGS}"
    )
    (kernel_sets if args.kernel_sets else compare)(args)


if __name__ == "__main__":
    main()
