"""The full-vocabulary passes of the trainer and the engine, by the rows each chunk holds.

    python bench/full_vocab.py [--repeats 3]

``full_logprobs_and_entropy`` (forward, and forward + backward) and ``full_logprobs`` (the log-probs alone, the
metrics' path of the sparse heads) over the logits of a GRPO step's responses: 560 rows of SmolLM2's
49152 ids and 300 rows of Qwen3's 151936, float32. Each at the chunk the library now takes on a CPU
(``chunk_rows_for``: about ``CPU_CHUNK_BYTES`` of temporaries) and at the former 1024 rows. Every figure is the
best of ``--repeats`` runs, in seconds.
"""

from __future__ import annotations

import argparse

import torch

from support_replay.core.logprobs import (
    CPU_CHUNK_BYTES,
    DEFAULT_CHUNK_ROWS,
    chunk_rows_for,
    full_logprobs,
    full_logprobs_and_entropy,
)
from support_replay.modeling.kernel_probe import cpu_identity
from timing import seconds_per_call

SHAPES = (("SmolLM2", 560, 49152), ("Qwen3", 300, 151936))


def best(fn, repeats: int) -> float:
    return seconds_per_call(fn, repeats, pick=min)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_identity()}")
    print(f"CPU chunk: {CPU_CHUNK_BYTES >> 20} MiB of temporaries\n")
    print("| logits | chunk rows | log-probs and entropy, forward s | forward + backward s | log-probs alone s |")
    print("|---|---:|---:|---:|---:|")
    for name, rows, vocab in SHAPES:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(rows, vocab, generator=g) * 3
        targets = torch.randint(0, vocab, (rows,), generator=g)
        leaf = logits.clone().requires_grad_()
        for chunk in (chunk_rows_for(logits), DEFAULT_CHUNK_ROWS):

            def forward_backward(chunk=chunk):
                leaf.grad = None
                lp, ent = full_logprobs_and_entropy(leaf, targets, 1.0, chunk_rows=chunk)
                (lp.sum() + ent.sum()).backward()

            with torch.no_grad():
                pair = best(lambda: full_logprobs_and_entropy(logits, targets, 1.0, chunk_rows=chunk), args.repeats)
                alone = best(lambda: full_logprobs(logits, targets, 1.0, chunk_rows=chunk), args.repeats)
            both = best(forward_backward, args.repeats)
            print(f"| {name}, {rows} x {vocab} | {chunk} | {pair:.3f} | {both:.3f} | {alone:.3f} |")


if __name__ == "__main__":
    main()
