"""GRPO step time and peak memory as the response length and the group size double.

    python bench/scaling.py [--lengths 64,128,256,512] [--groups 4,8,16] [--steps 2] [--trl-lengths 64,128,256]

SmolLM2-135M-Instruct, fp32, 4 prompts of the built-in arithmetic task (operands up to 20),
top_p 0.8 / top_k 32, replay and --ci-test on, one optimizer step per rollout, lr 1e-6. The
task's answers end after about 35 tokens, so every response runs to the asked length past
end-of-sequence (``--rollout-ignore-eos``). Each configuration runs in a process of its own, so
its peak resident memory (``ru_maxrss``) is its own; times are the mean of the steps after the
first.

TRL's GRPOTrainer (when installed) runs the same shapes at its defaults, fp32, its responses held
to the asked length by ``min_new_tokens`` (``generation_kwargs``), for the lengths in
``--trl-lengths`` and every group size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run_one(length: int, group: int, steps: int) -> dict:
    code = f"""
import json, resource, statistics, tempfile
from support_replay.train import train
from support_replay.train.config import RunConfig
cfg = RunConfig(num_rollout={steps}, rollout_batch_size=4, n_samples_per_prompt={group},
                global_batch_size={4 * group}, rollout_max_response_len={length}, rollout_ignore_eos=True,
                task_max_operand=20, rollout_top_p=0.8, rollout_top_k=32, lr=1e-6, ci_test=True, progress=False,
                output_dir=tempfile.mkdtemp())
rows = train(cfg)[1:]
keys = ("time_generate", "time_update", "time_step", "response_len_mean")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT", json.dumps({{**{{k: statistics.mean(r[k] for r in rows) for k in keys}}, "peak_mib": peak,
                          "diff": max(r["train_rollout_logprob_abs_diff_max"] for r in rows)}}))
"""
    return _result(code)


def run_trl(length: int, group: int, steps: int) -> dict:
    code = f"""
import json, resource, statistics, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from e2e import trl_steps
times = trl_steps({steps}, length={length}, group={group}, fixed_length=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT", json.dumps({{"time_step": statistics.mean(times[1:] or times), "peak_mib": peak}}))
"""
    return _result(code)


def _result(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--groups", default="4,8,16")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--trl-lengths", default="64,128,256", help="lengths TRL runs at (its 512 takes minutes a step); empty: none"
    )
    args = ap.parse_args()
    configs = [(int(n), 4) for n in args.lengths.split(",")] + [
        (64, int(g)) for g in args.groups.split(",") if int(g) != 4
    ]
    trl_lengths = {int(n) for n in args.trl_lengths.split(",") if n}
    try:
        import trl  # noqa: F401
    except ImportError:
        trl_lengths = set()
    print(
        "| response tokens | group size | samples | response len | generate s | update s | step s | peak memory MiB | "
        "max abs(log pi - log mu) "
        "| TRL step s | TRL peak MiB | ours faster by |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length, group in configs:
        r = run_one(length, group, args.steps)
        t = run_trl(length, group, args.steps) if length in trl_lengths else None
        theirs = f"{t['time_step']:.2f} | {t['peak_mib']:.0f} | {t['time_step'] / r['time_step']:.2f}x" if t else "| |"
        print(
            f"| {length} | {group} | {4 * group} | {r['response_len_mean']:.0f} | {r['time_generate']:.2f} | "
            f"{r['time_update']:.2f} | {r['time_step']:.2f} | "
            f"{r['peak_mib']:.0f} | {r['diff']:.1e} | {theirs} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
