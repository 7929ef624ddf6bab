"""GRPO step time and peak memory as the response length and the group size double.

    python bench/scaling.py [--lengths 64,128,256,512] [--groups 4,8,16] [--steps 2]

SmolLM2-135M-Instruct, fp32, 4 prompts of the built-in arithmetic task, top_p 0.8 / top_k 32,
replay and --ci-test on, one optimizer step per rollout. The task's answers end after about 35
tokens, so to make responses as long as asked the rollout bans the end-of-sequence tokens with
a logit bias of -100 (``--rollout-logit-bias``, replayed by the trainer like any bias; it takes
the dense LM head, as penalties do). Each configuration runs in a process of its own, so its peak
resident memory (``ru_maxrss``) is its own; times are the mean of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run_one(length: int, group: int, steps: int) -> dict:
    code = f"""
import json, resource, statistics, tempfile
from pathlib import Path
from transformers import AutoTokenizer
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.train import train
from support_replay.train.config import RunConfig
ckpt = smollm2_checkpoint()
tok = AutoTokenizer.from_pretrained(ckpt)
banned = {{str(i): -100.0 for i in {{tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}} if i is not None}}
bias = Path(tempfile.mkdtemp()) / "bias.json"
bias.write_text(json.dumps(banned))
cfg = RunConfig(num_rollout={steps}, rollout_batch_size=4, n_samples_per_prompt={group}, global_batch_size={4 * group}, rollout_max_response_len={length},
                rollout_top_p=0.8, rollout_top_k=32, lr=1e-6, ci_test=True, progress=False, output_dir=tempfile.mkdtemp(), rollout_logit_bias=str(bias))
rows = train(cfg)[1:]
keys = ("time_generate", "time_update", "time_step", "response_len_mean")
print("RESULT", json.dumps({{**{{k: statistics.mean(r[k] for r in rows) for k in keys}}, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          "diff": max(r["train_rollout_logprob_abs_diff_max"] for r in rows)}}))
"""
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
    args = ap.parse_args()
    configs = [(int(n), 4) for n in args.lengths.split(",")] + [(64, int(g)) for g in args.groups.split(",") if int(g) != 4]
    print("| response tokens | group size | samples | response len | generate s | update s | step s | peak memory MiB | max abs(log pi - log mu) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length, group in configs:
        r = run_one(length, group, args.steps)
        print(f"| {length} | {group} | {4 * group} | {r['response_len_mean']:.0f} | {r['time_generate']:.2f} | {r['time_update']:.2f} | {r['time_step']:.2f} | "
              f"{r['peak_mib']:.0f} | {r['diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
