"""The reference implementation's own end-to-end command at its size, on SmolLM2-135M-Instruct.

Its FSDP true-on-policy test (tests/train/test_reference_command.py holds the command as written there):
5 rollouts of 4 prompts x 4 samples, up to 1024 tokens, top_p 0.8 / top_k 32, --true-on-policy-mode
--ci-test, 2 trainer ranks (--actor-num-gpus-per-node 2) and, with --colocate and
--rollout-num-gpus-per-engine 1, two engines the run starts itself. Paths are changed (SmolLM2, a
gsm8k-style parquet of chat messages) and the flags our refusals name are removed, nothing else. Prints
one row per rollout and the run's totals.

    python bench/reference_command.py [--num-rollout 5] [--out runs/reference-command]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "train"), str(ROOT / "tests")]

from test_reference_command import REFERENCE, gsm8k_parquet, without  # noqa: E402

from support_replay.modeling.checkpoints import smollm2_checkpoint  # noqa: E402

# what our refusals name for this command on a CPU (the test finds them by running it)
REFUSED = [
    "--update-weight-buffer-size",
    "--sglang-true-on-policy-contract",
    "--sglang-attention-backend",
    "--attn-implementation",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=5)
    parser.add_argument("--out", default="runs/reference-command")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = gsm8k_parquet(out / "train.parquet")
    tokens = shlex.split(REFERENCE.format(checkpoint=smollm2_checkpoint(), data=data))
    for flag in REFUSED:
        tokens = without(tokens, flag)
    tokens += ["--num-rollout", str(args.num_rollout), "--output-dir", str(out / "run"), "--no-progress"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "support_replay.cli", "train", *tokens]
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    print(
        "\n| rollout | mean tokens | truncated | reward | max abs(dlogp) | generate s | score s | update s | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rollout']} | {r['response_len_mean']:.0f} | {r['truncated_share']:.2f} | {r['reward_mean']:.3f} "
            f"| {r['train_rollout_logprob_abs_diff_max']:.1e} | {r['time_generate']:.1f} | {r['time_score']:.1f} "
            f"| {r['time_update']:.1f} | {r['time_step']:.1f} |"
        )
    print(f"\nexit {done.returncode}, {len(rows)} rollouts in {wall:.0f} s wall (with start-up)")


if __name__ == "__main__":
    main()
