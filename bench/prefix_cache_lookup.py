"""The prefix cache's lookup at 1,000 and 16,000 entries (docs/reliability.md, issue 55 finding 8).

Two shapes of cache, each filled with ``--entries`` sequences, then a 64-prompt group looked up:

- ``one block``: entries of 16 random token ids (a page each: the default budget holds about 16,000);
  the prompts are 300 ids, each beginning with one entry;
- ``shared system prompt``: entries of 256 ids whose first 128 are one system prompt, the rest their
  own; the prompts are that system prompt, one entry's own 128 ids and 44 more.

Prints milliseconds per prompt (median of --rounds groups) and whether every lookup found its entry.

    python bench/prefix_cache_lookup.py [--entries 1000 16000] [--rounds 5]
"""

from __future__ import annotations

import argparse

import numpy as np

from support_replay.engine.block_pool import BlockPool
from support_replay.engine.prefix_cache import PrefixCache
from timing import seconds_per_call

GROUP, PAGE = 64, 16


def filled(entries: list[np.ndarray]) -> PrefixCache:
    pool = BlockPool(num_layers=1, block_size=PAGE, max_tokens=PAGE * (sum(-(-len(e) // PAGE) for e in entries) + 1))
    cache = PrefixCache(pool)
    block = 1
    for ids in entries:
        n = -(-len(ids) // PAGE)
        blocks = list(range(block, block + n))
        pool.refs[blocks] += 1  # the finished row's own hold, let go after the cache shares its blocks
        cache.store(ids.tolist(), blocks)
        pool.release(blocks)
        block += n
    return cache


def shapes(count: int, rng: np.random.Generator) -> dict[str, tuple[list[np.ndarray], list[list[int]], list[int]]]:
    vocab = 49152
    out = {}
    one = [rng.integers(0, vocab, PAGE) for _ in range(count)]
    picks = rng.integers(0, count, GROUP)
    prompts = [np.concatenate([one[i], rng.integers(0, vocab, 300 - PAGE)]).tolist() for i in picks]
    out["one block"] = (one, prompts, [PAGE] * GROUP)
    system = rng.integers(0, vocab, 128)
    shared = [np.concatenate([system, rng.integers(0, vocab, 128)]) for _ in range(count)]
    prompts = [np.concatenate([shared[i], rng.integers(0, vocab, 44)]).tolist() for i in picks]
    out["shared system prompt"] = (shared, prompts, [256] * GROUP)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, nargs="+", default=[1000, 16000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| shape | entries | ms per prompt | every prompt found its entry |")
    print("|---|---:|---:|---|")
    for count in args.entries:
        for name, (entries, prompts, expected) in shapes(count, rng).items():
            cache = filled(entries)
            found = [cache.match(p)[1] for p in prompts]
            seconds = seconds_per_call(lambda: [cache.match(p) for p in prompts], args.rounds)
            ok = "yes" if found == expected else f"no ({sum(f == e for f, e in zip(found, expected))} of {GROUP})"
            print(f"| {name} | {count:,} | {1000 * seconds / GROUP:.3f} | {ok} |")


if __name__ == "__main__":
    main()
