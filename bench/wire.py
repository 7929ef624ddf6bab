"""Bytes per token and encode/decode throughput of the support wire codec.

    python bench/wire.py [--tokens 200000] [--vocab 151936]

Compares, on one stream from the support-size distribution of bench/support_stream.py: our codec (plain and
relative to the selected tokens), int32 CSR (int32 ids + int64 offsets), the JSON
list-of-lists that SGLang returns, and the information bound log2 C(V, |S|-1) per token.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from support_replay.core import wire
from support_stream import support_stream


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    table, selected = support_stream(args.tokens, args.vocab, seed=0)
    sizes = table.sizes()
    nnz, tokens = table.nnz, table.num_rows
    print(
        f"stream: {tokens} tokens, V={args.vocab}, mean |S|={sizes.mean():.2f}, median={np.median(sizes):.0f}, "
        f"p99={np.percentile(sizes, 99):.0f}, singletons={np.mean(sizes == 1):.1%}, ids={nnz}"
    )
    bound_bits = sum(
        math.lgamma(args.vocab + 1) - math.lgamma(s) - math.lgamma(args.vocab - s + 2) for s in sizes.tolist()
    ) / math.log(2)

    rows = []

    def add(name, nbytes, enc_s, dec_s):
        rows.append((name, nbytes / tokens, nnz / enc_s / 1e6 if enc_s else None, nnz / dec_s / 1e6 if dec_s else None))

    blob = wire.encode(table, args.vocab)
    enc = best_time(lambda: wire.encode(table, args.vocab), args.repeats)
    dec = best_time(lambda: wire.decode(blob), args.repeats)
    assert wire.decode(blob) == table
    add("support-replay wire", len(blob), enc, dec)

    rel = wire.encode(table, args.vocab, selected)
    enc = best_time(lambda: wire.encode(table, args.vocab, selected), args.repeats)
    dec = best_time(lambda: wire.decode(rel, selected), args.repeats)
    assert wire.decode(rel, selected) == table
    add("support-replay wire, relative to a_t", len(rel), enc, dec)

    csr = table.ids.astype(np.int32).tobytes() + table.offsets.astype(np.int64).tobytes()
    add("int32 CSR (ids + int64 offsets)", len(csr), None, None)

    lists = table.to_lists()
    text = json.dumps(lists)
    enc = best_time(lambda: json.dumps(table.to_lists()), args.repeats)
    dec = best_time(lambda: json.loads(text), args.repeats)
    add("JSON list of lists (SGLang meta_info)", len(text), enc, dec)
    rows.append(("information bound log2 C(V, |S|-1)", bound_bits / 8 / tokens, None, None))

    def fmt(v):
        return f"{v:>10.1f}" if v is not None else f"{'-':>10}"

    print(f"\n| {'format':<40} | {'bytes/token':>11} | {'encode Mids/s':>13} | {'decode Mids/s':>13} |")
    print("|---|---:|---:|---:|")
    for name, bpt, e, d in rows:
        print(f"| {name:<40} | {bpt:>11.2f} | {fmt(e):>13} | {fmt(d):>13} |")


if __name__ == "__main__":
    main()
