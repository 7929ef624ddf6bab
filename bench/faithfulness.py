"""Why replay matters: the importance ratio pi/mu when the trainer scores the actor on the
full vocabulary versus on the replayed support, with the same weights on both sides.

    python bench/faithfulness.py [--prompts 32] [--samples 2] [--new-tokens 64]

SmolLM2-135M-Instruct on prompts of the built-in arithmetic task. For each setting the
engine samples with capture; the trainer then scores the same tokens with a fresh forward:
log pi over the full vocabulary, and log pi over the captured support. Reported per
setting: the mean ratio exp(log pi - log mu) and the share of tokens whose ratio lies
outside [0.9, 1.1]. In the untruncated control the support is the whole vocabulary, so
both columns are the full-vocabulary score.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, full_logprobs, support_logprobs
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.rollout import ArithmeticTask
from support_replay.rollout.generate import render_prompt

SETTINGS = [
    ("top_p 0.8 (top_k 1024)", dict(top_p=0.8, top_k=1024)),
    ("top_k 20", dict(top_k=20)),
    ("untruncated control", dict()),
]


def ratios(engine, model, prompts, params, samples, new_tokens):
    """Per-token ratios of the full-vocabulary and the replayed scores, and how many log pi != log mu."""
    capture = params.replay_active
    reqs = [
        GenerateRequest(ids, SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=k * samples + j),
                        max_new_tokens=new_tokens, return_sampling_mask=capture, return_logprob=not capture)
        for k, ids in enumerate(prompts) for j in range(samples)
    ]
    full_r, replay_r, unequal = [], [], 0
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor([req.input_ids + res.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(req.input_ids) - 1 : -1].float()
        targets = torch.tensor(res.output_ids)
        full = full_logprobs(logits, targets, params.temperature)
        mu = torch.from_numpy(res.log_mu if capture else res.full_logprobs)
        full_r.append(torch.exp(full - mu))
        replay = support_logprobs(logits, targets, res.support, params.temperature) if capture else full
        replay_r.append(torch.exp(replay - mu))
        unequal += int((replay != mu).sum())
    return torch.cat(full_r).double().numpy(), torch.cat(replay_r).double().numpy(), unequal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--true-on-policy", action="store_true", help="deterministic engine and batch-invariant scorer")
    args = ap.parse_args()
    path = smollm2_checkpoint()
    engine = Engine.from_pretrained(path, deterministic=args.true_on_policy).start()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.true_on_policy:
        make_batch_invariant(model)
    task = ArithmeticTask(seed=0)
    prompts = [render_prompt(engine.tokenizer, task[i], True)[0] for i in range(args.prompts)]
    mode = "true-on-policy (deterministic engine, batch-invariant scorer)" if args.true_on_policy else "normal mode"
    print(f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.samples} samples, up to {args.new_tokens} tokens, temperature 1, sglang semantics, {mode}")
    print("\n| rollout sampling | tokens | full vocab: mean ratio | outside [0.9, 1.1] | replay: mean ratio | outside [0.9, 1.1] | log pi != log mu |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, kw in SETTINGS:
        full, replay, unequal = ratios(engine, model, prompts, SamplingParams(temperature=1.0, **kw), args.samples, args.new_tokens)
        out = lambda r: np.mean((r < 0.9) | (r > 1.1))  # noqa: E731
        print(f"| {name} | {len(full)} | {full.mean():.3f} | {out(full):.1%} | {replay.mean():.4f} | {out(replay):.1%} | {unequal} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
