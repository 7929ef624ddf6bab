"""Why replay matters: the importance ratio pi/mu when the trainer scores the actor on the
full vocabulary versus on the replayed support, with the same weights on both sides.

    python bench/faithfulness.py [--prompts 32] [--samples 2] [--new-tokens 64]

SmolLM2-135M-Instruct on prompts of the built-in arithmetic task. For each setting the
engine samples with capture; the trainer then scores the same tokens with a fresh forward:
log pi over the full vocabulary, and log pi over the captured support. Reported per
setting: the mean ratio exp(log pi - log mu) and the share of tokens whose ratio lies
outside [0.9, 1.1]. In the untruncated control the support is the whole vocabulary, so
both columns are the full-vocabulary score.

A second table samples with penalties and a logit bias on (top_p 0.8, top_k 1024): the
full-vocabulary score, replay that ignores the penalty (what a system without penalty replay
computes), and replay with it (the engine's penalties applied to the actor's logits over the
token's own history, ``penalised_support_logprobs``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, full_logprobs, support_logprobs
from support_replay.core.logprobs import penalised_support_logprobs
from support_replay.core.penalties import Penalties
from support_replay.engine import Engine, EngineSettings
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.protocol import GenerateRequest
from support_replay.rollout import ArithmeticTask
from support_replay.rollout.generate import render_prompt
from support_replay.train.batches import penalty_rows

PENALTY_SETTINGS = [
    ("repetition 1.3", Penalties(repetition=1.3)),
    ("frequency 0.5, presence 0.3", Penalties(frequency=0.5, presence=0.3)),
    ("logit bias (10 ids, -5..+5)", None),  # drawn from the vocabulary in main
    ("all of them", None),
]
SETTINGS = [
    ("top_p 0.8 (top_k 1024)", dict(top_p=0.8, top_k=1024)),
    ("top_k 20", dict(top_k=20)),
    ("untruncated control", dict()),
]


def ratios(engine, model, prompts, params, samples, new_tokens):
    """Per-token ratios of the full-vocabulary and the replayed scores, and how many log pi != log mu."""
    capture = params.replay_active
    reqs = [
        GenerateRequest(
            ids,
            SamplingParams(
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=k * samples + j
            ),
            max_new_tokens=new_tokens,
            return_sampling_mask=capture,
            return_logprob=not capture,
        )
        for k, ids in enumerate(prompts)
        for j in range(samples)
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


def penalty_ratios(engine, model, prompts, penalties, samples, new_tokens):
    """Ratios of the full-vocabulary score, replay without the penalty, replay with it."""
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=1024)
    reqs = [
        GenerateRequest(
            ids,
            SamplingParams(temperature=1.0, top_k=1024, top_p=0.8, seed=k * samples + j),
            max_new_tokens=new_tokens,
            return_sampling_mask=True,
            penalties=penalties,
        )
        for k, ids in enumerate(prompts)
        for j in range(samples)
    ]
    full_r, plain_r, pen_r = [], [], []
    for req, res in zip(reqs, engine.generate(reqs)):
        sequence = torch.tensor([req.input_ids + res.output_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(req.input_ids) - 1 : -1].float()
        targets, mu = torch.tensor(res.output_ids), torch.from_numpy(res.log_mu)
        n, start = len(res.output_ids), len(req.input_ids)
        transform = penalty_rows(
            penalties,
            engine.semantics,
            sequence,
            torch.ones_like(sequence),
            torch.zeros(n, dtype=torch.long),
            start + torch.arange(n),
            torch.full((n,), start),
            res.support.to_padded()[0],
        )  # the trainer's own

        full_r.append(torch.exp(full_logprobs(logits, targets, params.temperature) - mu))
        plain_r.append(torch.exp(support_logprobs(logits, targets, res.support, 1.0) - mu))
        pen_r.append(torch.exp(penalised_support_logprobs(logits, targets, res.support, 1.0, transform) - mu))
    return [torch.cat(r).double().numpy() for r in (full_r, plain_r, pen_r)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--true-on-policy", action="store_true", help="deterministic engine and batch-invariant scorer")
    args = ap.parse_args()
    path = smollm2_checkpoint()
    engine = Engine.from_pretrained(path, EngineSettings(deterministic=args.true_on_policy)).start()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.true_on_policy:
        make_batch_invariant(model)
    task = ArithmeticTask(seed=0)
    prompts = [render_prompt(engine.tokenizer, task[i], True)[0] for i in range(args.prompts)]
    mode = "true-on-policy (deterministic engine, batch-invariant scorer)" if args.true_on_policy else "normal mode"
    print(
        f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.samples} samples, up to {args.new_tokens} tokens, "
        f"temperature 1, sglang semantics, {mode}"
    )
    print(
        "\n| rollout sampling | tokens | full vocab: mean ratio | outside [0.9, 1.1] | replay: mean ratio | outside "
        "[0.9, 1.1] | log pi != log mu |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, kw in SETTINGS:
        full, replay, unequal = ratios(
            engine, model, prompts, SamplingParams(temperature=1.0, **kw), args.samples, args.new_tokens
        )
        out = lambda r: np.mean((r < 0.9) | (r > 1.1))  # noqa: E731
        print(
            f"| {name} | {len(full)} | {full.mean():.3f} | {out(full):.1%} | {replay.mean():.4f} | {out(replay):.1%} "
            f"| {unequal} |"
        )
    if not args.true_on_policy:
        vocab = engine.vocab_size
        gen = torch.Generator().manual_seed(0)
        bias = {int(i): float(b) for i, b in zip(torch.randperm(vocab, generator=gen)[:10], torch.linspace(-5, 5, 10))}
        bias[engine.tokenizer.eos_token_id] = -5.0  # a bias that touches tokens the model does sample
        settings = [
            (
                name,
                p
                or (
                    Penalties.with_bias(logit_bias=bias) if "bias" in name else Penalties.with_bias(0.5, 0.3, 1.3, bias)
                ),
            )
            for name, p in PENALTY_SETTINGS
        ]
        print("\nWith penalties (top_p 0.8, top_k 1024, sglang semantics):")
        print(
            "\n| penalty | tokens | full vocab: mean ratio | outside | replay without the penalty: mean ratio | "
            "outside | replay with it: mean ratio | outside |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, p in settings:
            full, plain, pen = penalty_ratios(engine, model, prompts, p, args.samples, args.new_tokens)
            out = lambda r: np.mean((r < 0.9) | (r > 1.1))  # noqa: E731
            print(
                f"| {name} | {len(full)} | {full.mean():.3f} | {out(full):.1%} | {plain.mean():.3f} | "
                f"{out(plain):.1%} | {pen.mean():.4f} | {out(pen):.1%} |"
            )
    engine.shutdown()


if __name__ == "__main__":
    main()
