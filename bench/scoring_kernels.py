"""Forward + backward time and peak extra memory of the actor-scoring kernels.

    python bench/scoring_kernels.py [--tokens 2048] [--vocab 151936] [--hidden 1024] [--repeats 3]

For K in {8, 64, 512} and the support-size distribution of bench/support_stream.py (padded to its largest
support), each cell runs in its own process so that the peak resident memory it reports
(ru_maxrss after the run minus after the inputs were built) belongs to that kernel alone:

  (a) dense [T, V] mask + masked log_softmax (what a peer implementation does)
  (b) support_logprobs on the same logits
  (c) full LM head from hidden states + full-vocabulary log_softmax
  (d) sparse_head_support_logprobs from the same hidden states (never forms [T, V])
  (e) penalised_support_logprobs on the logits of (b): repetition, frequency and presence
      penalties and a 100-id logit bias (vLLM's rules), over a history of a 2048-token prompt
      and the response so far; compared with (b)

Extra memory includes the gradient of the input (logits for a/b; weight and hidden for c/d).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from support_replay import SupportTable, sparse_head_support_logprobs, support_logprobs  # noqa: E402
from support_replay.core.logprobs import penalised_support_logprobs  # noqa: E402
from support_replay.core.penalties import Penalties  # noqa: E402
from support_replay.train.batches import penalty_rows  # noqa: E402
from support_stream import support_stream  # noqa: E402

VARIANTS = {
    "a": "dense mask + log_softmax",
    "b": "support_logprobs",
    "c": "full LM head + log_softmax",
    "d": "sparse_head_support_logprobs",
    "e": "penalised_support_logprobs",
}
BASE = {"a": "a", "b": "a", "c": "c", "d": "c", "e": "b"}


def build_support(k: str, tokens: int, vocab: int) -> tuple[SupportTable, torch.Tensor]:
    if k == "spec":
        table, selected = support_stream(tokens, vocab, seed=0)
    else:
        table, selected = support_stream(tokens, vocab, seed=0, sizes=np.full(tokens, int(k)))
    return table, torch.from_numpy(selected)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def penalty_inputs(targets: torch.Tensor, vocab: int, prompt_tokens: int = 2048):
    """One sequence, a random prompt then the response ``targets``, and its rows: what the
    trainer's ``penalty_rows`` counts the histories from (here inside every step)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen)
    sequence = torch.cat([prompt, targets])[None]
    tokens = len(targets)
    rows_b = torch.zeros(tokens, dtype=torch.long)
    rows_pos = prompt_tokens + torch.arange(tokens)
    rows_start = torch.full((tokens,), prompt_tokens)
    bias_ids = torch.randperm(vocab, generator=gen)[:100].tolist()
    p = Penalties.with_bias(0.3, 0.2, 1.2, {i: 1.0 for i in bias_ids})
    return p, sequence, torch.ones_like(sequence), rows_b, rows_pos, rows_start


def run_one(variant: str, k: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    torch.manual_seed(0)
    table, targets = build_support(k, tokens, vocab)
    ids, valid = table.to_padded()
    if variant in "abe":
        logits = torch.randn(tokens, vocab, requires_grad=True)
    else:
        h = torch.randn(tokens, hidden, requires_grad=True)
        weight = (torch.randn(vocab, hidden) * hidden**-0.5).requires_grad_()

    def step():
        if variant == "a":
            mask = torch.zeros(tokens, vocab, dtype=torch.bool).scatter_(1, ids, valid)
            out = logits.masked_fill(~mask, float("-inf")).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
            out.sum().backward()
        elif variant == "b":
            support_logprobs(logits, targets, (ids, valid)).sum().backward()
        elif variant == "c":
            out = (h @ weight.T).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
            out.sum().backward()
        elif variant == "d":
            sparse_head_support_logprobs(h, weight, targets, (ids, valid)).sum().backward()
        else:
            p, sequence, mask, rows_b, rows_pos, rows_start = penalty
            transform = penalty_rows(p, "vllm", sequence, mask, rows_b, rows_pos, rows_start, ids)
            penalised_support_logprobs(logits, targets, (ids, valid), 1.0, transform).sum().backward()

    if variant == "e":
        penalty = penalty_inputs(targets, vocab)

    def clear():
        for p in [logits] if variant in "abe" else [h, weight]:
            p.grad = None
        gc.collect()

    gc.collect()
    base = rss_mb()
    step()
    peak = rss_mb() - base
    clear()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        clear()
    return {"time_s": min(times), "extra_mb": peak, "k_padded": int(ids.shape[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="8,64,512,spec")
    ap.add_argument("--variants", default="abcde", help="subset of a-e to run (speed-ups need a, b and c)")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "K"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.tokens, args.vocab, args.hidden, args.repeats)))
        return

    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(
        f"T={args.tokens} V={args.vocab} H={args.hidden} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"THP_MEM_ALLOC_ENABLE={thp}"
    )
    common = [
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--repeats",
        str(args.repeats),
    ]
    rows = []
    for k in args.ks.split(","):
        cell = {}
        for v in args.variants:
            out = subprocess.run(
                [sys.executable, __file__, *common, "--one", v, k], capture_output=True, text=True, check=True
            )
            cell[v] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((k, cell))
        print(f"  done K={k}", file=sys.stderr)

    print("\n| K (padded) | variant | fwd+bwd s | extra MB | speed-up | memory ratio |  (e: vs b; b: vs a; d: vs c)")
    print("|---|---|---:|---:|---:|---:|")
    for k, cell in rows:
        label = f"{k} ({next(iter(cell.values()))['k_padded']})" if k == "spec" else k
        for v, name in VARIANTS.items():
            if v not in cell:
                continue
            base = cell.get(BASE[v])
            speed = f"{base['time_s'] / cell[v]['time_s']:.1f}x" if base else "-"
            mem = f"{base['extra_mb'] / max(cell[v]['extra_mb'], 1e-9):.1f}x" if base else "-"
            print(f"| {label} | ({v}) {name} | {cell[v]['time_s']:.3f} | {cell[v]['extra_mb']:.0f} | {speed} | {mem} |")


if __name__ == "__main__":
    main()
