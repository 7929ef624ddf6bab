"""The KV memory budget and the block pool on SmolLM2-135M-Instruct (docs/engines.md, "KV memory budget").

1. The largest batch x context one admission takes under the default budget (half the memory
   available at start, serve's share), fp32 and bf16.
2. 64 requests at once: one prompt of 8,000 tokens and 63 of 16, 32 new tokens each, under the
   default budget: every request answered, the engine process's peak RSS, how many admissions it
   took, and what a rectangle of slots would have asked for (64 slots x the long row).
3. What reading the pool costs a decode step: batch x width, the step's time, the time its 30
   layers spend getting their keys and values (``PagedCache.attended``: a strided view for rows
   prefilled together, an ``index_select`` for gathered rows), their share (``--gather-only`` runs
   this table alone).

    python bench/kv_budget.py [--long 8000] [--short 63] [--max-new 32] [--dtype float32] [--gather-only]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from support_replay import SamplingParams
from support_replay.engine import Engine
from support_replay.engine.kv_budget import available_bytes, column_need, kv_bytes_per_token, largest_batch
from support_replay.engine.paged_cache import PagedCache
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.protocol import GenerateRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--short", type=int, default=63)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gather-only", action="store_true")
    args = ap.parse_args()
    path = smollm2_checkpoint()
    if args.gather_only:
        return gather_costs(path)
    print(f"memory available at start: {available_bytes() / 2**30:.1f} GiB")
    print(
        "\n| dtype | bytes per KV position | default budget (positions) | budget (GiB) | largest batch at 512 + 512 | "
        "at 2048 + 2048 | at 7,168 + 1,024 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine.from_pretrained(path, dtype=dtype)
        b = engine.kv_budget
        page = engine.runner.pool.block_size
        shapes = [largest_batch(b, p, n, page) for p, n in ((512, 512), (2048, 2048), (7168, 1024))]
        print(
            f"| {str(dtype).removeprefix('torch.')} | {b.bytes_per_token:,} | {b.max_total_tokens:,} | "
            f"{b.bytes / 2**30:.1f} | " + " | ".join(f"{s:,}" for s in shapes) + " |"
        )
        del engine

    engine = Engine.from_pretrained(path, dtype=getattr(torch, args.dtype))
    prefills = []
    real = engine.runner._prefill
    engine.runner._prefill = lambda prompts: prefills.append(len(prompts)) or real(prompts)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prompts = [torch.randint(100, vocab, (args.long,), generator=gen).tolist()]
    prompts += [torch.randint(100, vocab, (16,), generator=gen).tolist() for _ in range(args.short)]
    reqs = [
        GenerateRequest(
            p,
            SamplingParams(top_k=50, top_p=0.9, seed=i),
            max_new_tokens=args.max_new,
            ignore_eos=True,
            return_sampling_mask=True,
        )
        for i, p in enumerate(prompts)
    ]
    per_token = kv_bytes_per_token(engine.runner.model)
    unbudgeted = len(reqs) * column_need(args.long, args.max_new, 1) * per_token
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = engine.generate(reqs)
    secs = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"\n{len(reqs)} requests (one of {args.long:,} prompt tokens, {args.short} of 16), {args.max_new} new tokens "
        f"each, {args.dtype}, "
        f"default budget {engine.kv_budget.max_total_tokens:,} positions ({engine.kv_budget.bytes / 2**30:.1f} GiB):"
    )
    print(
        "| answered | admissions (prefill batches) | time (s) | peak RSS (GiB) | RSS before (GiB) | a rectangle of "
        "slots without a budget (GiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {sum(c.num_tokens == args.max_new for c in out)} of {len(reqs)} | {len(prefills)} | {secs:.1f} | "
        f"{peak / 2**20:.1f} | "
        f"{before / 2**20:.1f} | {unbudgeted / 2**30:.1f} |"
    )

    del engine
    gather_costs(path)


def gather_costs(path, steps: int = 12) -> None:
    """Decode steps of ``batch`` rows at ``width`` positions (fp32, fused step): the step and its gathers."""
    engine = Engine.from_pretrained(path)
    spent = [0.0]
    real = PagedCache.attended

    def timed(self, layer, group=None):
        start = time.perf_counter()
        out = real(self, layer, group)
        spent[0] += time.perf_counter() - start
        return out

    PagedCache.attended = timed
    print("\n| batch | width (positions) | decode step (ms) | getting keys and values (ms) | share |")
    print("|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(1)
    for batch, width in ((16, 128), (16, 640), (64, 640), (16, 2048)):
        prompts = [
            torch.randint(100, engine.vocab_size, (width - steps,), generator=gen).tolist() for _ in range(batch)
        ]
        reqs = [
            GenerateRequest(p, SamplingParams(top_k=50, seed=i), max_new_tokens=steps, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        futures = engine.submit_all(reqs)
        engine.step()  # the admission's prefill
        times = []
        while not all(f.done() for f in futures):
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start, spent[0]))
        times = sorted(times[1:-1])  # the first and last steps do more than decode
        step, gathers = times[len(times) // 2]
        print(f"| {batch} | {width:,} | {step * 1e3:.1f} | {gathers * 1e3:.1f} | {gathers / step:.0%} |")
    PagedCache.attended = real
    engine.shutdown()


if __name__ == "__main__":
    main()
