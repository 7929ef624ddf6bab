"""Many rollouts without a weight update between them: whether each group's rows stay in place, and the speed.

    python bench/rollouts_in_place.py [--rounds 40] [--max-total-tokens 40000] [--window 10]

``bench/engine.py``'s GRPO work (4 chat prompts x 4 samples, 64 tokens, EOS ignored, capture on) on
SmolLM2-135M-Instruct, ``--rounds`` times on one engine with no update between (an evaluation, a server's
stream of sampling requests): every finished row's blocks stay in the prefix cache, among the freed ones, and the
pool's untouched tail runs out after a number of rounds set by ``--max-total-tokens`` (at the engine's default
budget on a 24 GB machine, about 148 rounds). Prints, per window of ``--window`` rounds, the median tokens/s, the
groups whose rows were not given runs at one pitch (so not attended in place: engine/paged_cache.py), the prefix
cache's evictions and the minor page faults (fresh pool pages written for the first time).
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

from engine import resolve_model, shaped_rate
from support_replay.engine import Engine, EngineSettings
from support_replay.modeling.kernel_probe import cpu_identity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--max-total-tokens", type=int, default=40000)
    ap.add_argument("--window", type=int, default=10)
    args = ap.parse_args()
    engine = Engine.from_pretrained(
        resolve_model("smollm2"), EngineSettings(max_total_tokens=args.max_total_tokens), dtype=torch.float32
    )
    pool = engine.runner.pool
    misses = [0]
    allocate_rows = pool.allocate_rows

    def counted(sizes):
        rows = allocate_rows(sizes)
        misses[0] += rows is None
        return rows

    pool.allocate_rows = counted
    print(
        f"CPU: {cpu_identity()}, {torch.get_num_threads()} threads; pool of {pool.blocks} blocks of {pool.block_size}"
    )
    print("\n| rounds | tokens/s, median | groups not in place | entries evicted | page faults a round |")
    print("|---|---:|---:|---:|---:|")
    rates, before = [], (0, 0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    for r in range(args.rounds):
        rates.append(shaped_rate(engine, 4, 4, 64, 1, share=True, seed_base=10 + r))
        if (r + 1) % args.window == 0:
            now = (misses[0], engine.prefix_cache.stats.evicted, resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            print(
                f"| {r + 2 - args.window}-{r + 1} | {statistics.median(rates):.1f} | {now[0] - before[0]} "
                f"| {now[1] - before[1]} | {(now[2] - before[2]) // args.window} |",
                flush=True,
            )
            rates, before = [], now


if __name__ == "__main__":
    main()
