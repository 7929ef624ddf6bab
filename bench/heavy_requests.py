"""A good request beside a heavy one (docs/reliability.md, finding 6), on SmolLM2-135M-Instruct fp32.

The heavy request asks for everything that used to cost the engine thread more than linear work
per step: support-mode log-probs over a support of 4,096 ids (top_k 4096), a frequency penalty, and
16 stop strings of 256 characters that never match. The good one samples 64 tokens at top_k 50.
Prints the good request's time alone and beside the heavy one (median of --rounds), and the
support-mode capture of one row, the old way (the row expanded to |S| x |S|) and the new.

    python bench/heavy_requests.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from support_replay import SamplingParams, support_logprobs
from support_replay.core.logprobs import support_row_logprobs
from support_replay.core.penalties import Penalties
from support_replay.engine import Engine, EngineSettings
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.protocol import GenerateRequest
from timing import seconds_per_call


def quadratic_row_logprobs(logits_row: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """What the engine did before: the row expanded to |S| rows, one per id as the selected token."""
    n = len(ids)
    return support_logprobs(
        logits_row.expand(n, -1), ids, (ids.expand(n, n), torch.ones(n, n, dtype=torch.bool)), temperature
    )


def timed(fn, rounds: int) -> float:
    return seconds_per_call(fn, rounds, warmup=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    engine = Engine.from_pretrained(smollm2_checkpoint(), EngineSettings(sampling_mask_max_tokens=4096))
    prompt = engine.tokenizer("Write a short story about a robot who learns to paint.")["input_ids"]
    good = lambda seed: GenerateRequest(
        prompt,
        SamplingParams(top_k=50, top_p=0.9, seed=seed),
        max_new_tokens=args.tokens,  # noqa: E731
        ignore_eos=True,
        return_sampling_mask=True,
    )
    heavy = GenerateRequest(
        prompt,
        SamplingParams(top_k=4096, seed=1),
        max_new_tokens=args.tokens,
        ignore_eos=True,
        return_sampling_mask=True,
        sampling_logprobs_mode="support",
        penalties=Penalties(frequency=0.5),
        stop=[f"\x00{i:02d}" + "x" * 252 for i in range(16)],
    )
    engine.generate([good(0)])  # warm-up
    alone = timed(lambda: engine.generate([good(2)]), args.rounds)
    beside = timed(lambda: engine.generate([good(2), heavy]), args.rounds)
    heavy_alone = timed(lambda: engine.generate([heavy]), args.rounds)
    out = engine.generate([heavy])[0]
    sizes = out.support.sizes()

    gen = torch.Generator().manual_seed(0)
    row = torch.randn(engine.vocab_size, generator=gen) * 3
    ids = torch.randperm(engine.vocab_size, generator=gen)[:4096]
    old = timed(lambda: quadratic_row_logprobs(row, ids, 1.0), 3)
    new = timed(lambda: support_row_logprobs(row, ids, 1.0), 20)
    assert np.array_equal(quadratic_row_logprobs(row, ids, 1.0).numpy(), support_row_logprobs(row, ids, 1.0).numpy())

    print(
        f"\nSmolLM2 fp32, {args.tokens} new tokens, median of {args.rounds}; the heavy request's supports: mean |S| "
        f"{sizes.mean():.0f}"
    )
    print(
        "| good request alone (s) | beside the heavy one (s) | slowdown | heavy alone (s) | support-mode capture of "
        "one |S|=4096 row: before (ms) | now (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {alone:.2f} | {beside:.2f} | {beside / alone:.2f}x | {heavy_alone:.2f} | {old * 1000:.0f} | "
        f"{new * 1000:.2f} |"
    )


if __name__ == "__main__":
    main()
