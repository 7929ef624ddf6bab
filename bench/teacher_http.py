"""What a distillation teacher costs by where it runs: beside the actor, behind `support-replay serve`
(``/score_support``: each position's own ids) and behind SGLang's own server (``token_ids_logprob``: one id list
per request, so the union of the sample's support ids at every position).

    python bench/teacher_http.py [--rollouts 2]

Student and teacher SmolLM2-135M-Instruct (the same weights: the point is the wire; the divergence is then the
student's own log mass outside each support, -log Pi(S_t), about 0.17 a token at top_p 0.8), the
defaults' rollouts (8 prompts x 4 samples, top_p 0.8, top_k 32), ``--use-opd``. Printed per run: the teacher's
ids sent and needed (the support ids of every trained token), the seconds the teacher took a rollout (HTTP: its
requests; in process: the rollout's scoring pass, the teacher's alone here: one optimizer step a rollout, so the
student's old log-probs come from the update's own forward) and the run's mean step time. SGLang runs where
``make sglang`` installed it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.train import train
from support_replay.train.config import RunConfig


def run(name: str, rollouts: int, **teacher) -> dict:
    cfg = RunConfig(
        num_rollout=rollouts,
        progress=False,
        use_opd=True,
        output_dir=tempfile.mkdtemp(prefix="bench-teacher-"),
        **teacher,
    )
    rows = train(cfg)
    out = {"run": name, "step": statistics.mean(r["time_step"] for r in rows)}
    if "opd_teacher_ids_sent" in rows[0]:
        out["sent"] = sum(r["opd_teacher_ids_sent"] for r in rows)
        out["needed"] = sum(r["opd_teacher_ids_needed"] for r in rows)
        out["teacher_s"] = sum(r["opd_teacher_seconds"] for r in rows) / rollouts
    else:
        out["teacher_s"] = statistics.mean(r["time_score"] for r in rows)
    out["divergence"] = statistics.mean(r["opd_divergence"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from processes import engine_process, free_port
    from sglang_env import sglang_missing, sglang_process

    checkpoint = smollm2_checkpoint()
    print(f"CPU: {cpu_identity()}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct fp32 student and teacher\n")
    results = [run("in process", args.rollouts, opd_teacher_load=str(checkpoint))]
    ctx, url = engine_process(checkpoint)
    with ctx:
        results.append(run("support-replay serve", args.rollouts, opd_teacher_url=url))
    why = sglang_missing()
    if why is None:
        ctx, url = sglang_process(checkpoint, free_port())
        with ctx:
            results.append(run("SGLang 0.5.23 (its server)", args.rollouts, opd_teacher_url=url))
    print("| teacher | ids sent | ids needed | sent / needed | teacher s a rollout | step s | divergence |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        sent = f"{r['sent']:,} | {r['needed']:,} | {r['sent'] / r['needed']:.1f}x" if "sent" in r else "- | - | -"
        print(f"| {r['run']} | {sent} | {r['teacher_s']:.2f} | {r['step']:.1f} | {r['divergence']:.2e} |")
    if why is not None:
        print(f"\nSGLang not run: {why}")


if __name__ == "__main__":
    main()
