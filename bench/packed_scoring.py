"""One GRPO group's scoring forward and backward: unpacked, packed with one mask over the row, packed per sequence.

    python bench/packed_scoring.py [--lengths 128,512] [--group 4] [--prompt 44] [--repeats 2]

SmolLM2-135M-Instruct, fp32, the trainer's ``ScoringModel`` on the run's default kernel, a
prompt of ``--prompt`` random tokens and ``--group`` responses of each length (random tokens, a
support of about 6 ids per token, the sparse head). ``unpacked``: one row per sample;
``packed, one mask``: the prompt once and every response after it, attention over the whole
packed row with a ``[L, L]`` mask (what packed scoring did before 2026-11-30);
``packed, per sequence``: the same row, the attention taken apart per sequence
(modeling/packed_sequences.py); ``packed, default``: per sequence where the rule
(``PER_SEQUENCE_GAIN``) says it saves enough scores, else the mask. Best of ``--repeats`` after
one warm-up.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from support_replay.core.support import SupportTable
from support_replay.modeling import packed_sequences
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.linear_kernels import resolve_linear_kernel
from support_replay.rollout.sample import Sample
from support_replay.train.actor import load_scoring_model, score_batch
from support_replay.train.batches import build_micro_batch

GAIN = packed_sequences.PER_SEQUENCE_GAIN
# (name, packed, attention per sequence: False / True / None for the default rule, PER_SEQUENCE_GAIN)
VARIANTS = [
    ("unpacked", False, False),
    ("packed, one mask over the row", True, False),
    ("packed, per sequence", True, True),
    ("packed, default", True, None),
]


def group(prompt_len: int, length: int, size: int, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(length)
    prompt = rng.integers(5, vocab, prompt_len).tolist()
    samples = []
    for j in range(size):
        response = rng.integers(5, vocab, length).tolist()
        rows = [np.unique(np.append(rng.integers(0, vocab, 5), t)).astype(np.int32) for t in response]
        samples.append(
            Sample(
                index=j,
                group=0,
                prompt_ids=prompt,
                response_ids=response,
                loss_mask=np.ones(length, np.int8),
                log_mu=np.zeros(length, np.float32),
                support=SupportTable.from_rows(rows),
            )
        )
    return samples


def seconds(model, samples, pack: bool, per_sequence: bool | None) -> float:
    model.per_sequence_attention = (
        per_sequence is not False
    )  # the actor's switch: pass the packed row's segments to the attention
    packed_sequences.PER_SEQUENCE_GAIN = GAIN if per_sequence is None else 0.0
    batch = build_micro_batch(samples, list(range(len(samples))), True, "cpu", pack=pack)
    model.zero_grad()
    start = time.perf_counter()
    scores = score_batch(model, batch, 1.0, sparse=True)
    scores.logp.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=44)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = load_scoring_model(
        smollm2_checkpoint(), "cpu", linear_kernel=resolve_linear_kernel("auto", torch.float32, "cpu")
    )
    vocab = model.hf.get_output_embeddings().weight.shape[0]
    print(f"\n| response tokens | group | {' | '.join(name + ' s' for name, _, _ in VARIANTS)} |")
    print("|---:|---:|" + "---:|" * len(VARIANTS))
    for length in [int(x) for x in args.lengths.split(",")]:
        samples = group(args.prompt, length, args.group, vocab)
        best = []
        for _, pack, per_sequence in VARIANTS:
            seconds(model, samples, pack, per_sequence)  # warm-up
            best.append(min(seconds(model, samples, pack, per_sequence) for _ in range(args.repeats)))
        print(f"| {length} | {args.group} | {' | '.join(f'{b:.2f}' for b in best)} |", flush=True)


if __name__ == "__main__":
    main()
