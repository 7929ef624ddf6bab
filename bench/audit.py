"""``support-replay audit`` on SmolLM2 with the in-process engine, one row per setup: how long it takes and
what it finds (docs/audit.md, "seen here"; docs/benchmarks.md).

    python bench/audit.py [--rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from support_replay.audit import AuditSettings, run_audit
from support_replay.train.config import RunConfig

SETUPS = {
    "fp32, top_p 0.8 / top_k 32": {},
    "+ repetition penalty 1.2": {"rollout_repetition_penalty": 1.2},
    "true-on-policy mode": {"true_on_policy_mode": True},
    "bf16 engine, fp32 trainer": {"rollout_dtype": "bfloat16"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout-batch-size", type=int, default=8)
    ap.add_argument("--n-samples-per-prompt", type=int, default=4)
    ap.add_argument("--rollout-max-response-len", type=int, default=32)
    args = ap.parse_args()
    print(
        "| setup | tokens | wall s | truncation | penalties | numerics | trainer KL | trainer max abs | flips | "
        "verdict |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    for name, overrides in SETUPS.items():
        with tempfile.TemporaryDirectory() as out:
            cfg = RunConfig(
                rollout_batch_size=args.rollout_batch_size,
                n_samples_per_prompt=args.n_samples_per_prompt,
                global_batch_size=args.rollout_batch_size * args.n_samples_per_prompt,
                rollout_max_response_len=args.rollout_max_response_len,
                output_dir=out,
                progress=False,
                **overrides,
            )
            start = time.perf_counter()
            report = run_audit(cfg, AuditSettings())
            wall = time.perf_counter() - start
        causes, trainer, flips = report["causes"], report["scorings"]["trainer"], report["boundary_flips"]
        shares = " | ".join(f"{causes[c]['share']:.1%}" for c in ("truncation", "penalties", "numerics"))
        flipped = f"{flips['share']:.1%}" if flips["checked"] else "not checked"
        print(
            f"| {name} | {report['tokens']} | {wall:.1f} | {shares} | {trainer['mismatch_kl']:.2e} | "
            f"{trainer['abs_diff_max']:.2e} | {flipped} | {'pass' if report['verdict']['pass'] else 'FAIL'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
