"""The sampler at a decode step: SGLang's rule with top-k, capture on, by how it selects the top-k candidates.

    python bench/sampling.py [--repeats 200]

``sample_tokens`` over 16 rows of SmolLM2's 49152 ids and of Qwen3's 151936 (float32, temperature 1, top_k 32,
top_p 0.8: the GRPO shape of bench/engine.py), with ``torch.topk``'s selection and with the compiled one
(modeling/top_candidates.py; the same tokens, support and log mu, checked here); and each selection alone. The
softmax over ``[B, V]`` that both take is shown beside them. Microseconds per call, the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from support_replay import SamplingParams, sample_tokens
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.modeling.top_candidates import compiled

SHAPES = (("SmolLM2", 16, 49152), ("Qwen3", 16, 151936))
PARAMS = dict(temperature=1.0, top_k=32, top_p=0.8)


def median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


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


if __name__ == "__main__":
    main()
