"""The sampler at a decode step: SGLang's rule with top-k, capture on, by how it selects the top-k candidates.

    python bench/sampling.py [--repeats 200]

``sample_tokens`` over 16 rows of SmolLM2's 49152 ids and of Qwen3's 151936 (float32, temperature 1, top_k 32,
top_p 0.8: the GRPO shape of bench/engine.py), with ``torch.topk``'s selection and with the compiled one
(kernels/top_candidates.py; the same tokens, support and log mu, checked here); and each selection alone. The
softmax over ``[B, V]`` that both take is shown beside them. Then each selection alone on rows that are hard for
the compiled one, at widths 32 and 1024: sorted ascending or descending, flat, a grammar's mask (98% exact zeros),
two values (the same ids selected, checked here). Microseconds per call, the median of ``--repeats``.
"""

from __future__ import annotations

import argparse

import torch

from support_replay import SamplingParams, sample_tokens
from support_replay.kernels.top_candidates import compiled
from support_replay.modeling.kernel_probe import cpu_identity
from timing import seconds_per_call

SHAPES = (("SmolLM2", 16, 49152), ("Qwen3", 16, 151936))
PARAMS = dict(temperature=1.0, top_k=32, top_p=0.8)


def median_us(fn, repeats: int) -> float:
    return 1e6 * seconds_per_call(fn, repeats, warmup=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    select, why = compiled()
    if select is None:
        raise SystemExit(f"the compiled selection cannot run here: {why}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_identity()}\n")
    print("| logits | softmax us | torch.topk us | compiled selection us | sample_tokens, torch.topk us | "
          "sample_tokens, compiled us |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows, vocab in SHAPES:
        logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        params = [SamplingParams(seed=i, **PARAMS) for i in range(rows)]
        probs = torch.softmax(logits, -1)
        width = PARAMS["top_k"]

        def sample(chosen):
            generators = [torch.Generator().manual_seed(i) for i in range(rows)]
            return sample_tokens(logits, params, "sglang", generator=generators, select=chosen)

        plain, fast = sample(None), sample(select)
        same = torch.equal(plain.tokens, fast.tokens) and plain.support == fast.support
        if not (same and torch.equal(plain.log_mu, fast.log_mu)):
            raise SystemExit(f"{name}: the two selections sampled differently")
        cells = [
            median_us(lambda: torch.softmax(logits, -1), args.repeats),
            median_us(lambda: torch.topk(probs, width, dim=-1), args.repeats),
            median_us(lambda: select(probs, width), args.repeats),
            median_us(lambda: sample(None), args.repeats),
            median_us(lambda: sample(select), args.repeats),
        ]
        print(f"| {name} {rows} x {vocab} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    hard_rows(select, args.repeats)


def hard_rows(select, repeats: int) -> None:
    """The selections alone on 16 rows of 49152 shaped against the compiled one's shortcut (a chunk's largest value)."""
    rows, vocab = 16, 49152
    g = torch.Generator().manual_seed(1)
    smooth = torch.softmax(3 * torch.randn(rows, vocab, generator=g), -1)
    masked = smooth.clone()
    masked[torch.rand(rows, vocab, generator=g) < 0.98] = 0.0
    cases = {
        "smooth (softmax of 3 x normal)": smooth,
        "sorted ascending": torch.sort(smooth, dim=-1).values,
        "sorted descending": torch.sort(smooth, dim=-1, descending=True).values,
        "flat (every value tied)": torch.full((rows, vocab), 1.0 / vocab),
        "a grammar's mask (98% exact zeros)": masked,
        "two values": (torch.rand(rows, vocab, generator=g) < 0.5).float(),
    }
    print(f"\n| {rows} rows x {vocab} | width | torch.topk us | compiled selection us |")
    print("|---|---:|---:|---:|")
    for name, probs in cases.items():
        for width in (32, 1024):
            want = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :width]
            if not torch.equal(select(probs, width)[1], want):
                raise SystemExit(f"{name}, width {width}: the compiled selection differs from the full sort")
            cells = (
                median_us(lambda: torch.topk(probs, width, dim=-1), repeats),
                median_us(lambda: select(probs, width), repeats),
            )
            print(f"| {name} | {width} | {cells[0]:.0f} | {cells[1]:.0f} |")


if __name__ == "__main__":
    main()
