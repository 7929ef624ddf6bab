"""True-on-policy mode's invariant product (kernels/invariant.py) against MKL's and oneDNN's at the engine's decode
shapes and the trainer's, on SmolLM2-135M's layers: GFLOP/s, float32 and bf16, at this machine's thread count.

    python bench/invariant_product.py [--rounds 5] [--train-rows 2048]

Each cell is the median of ``--rounds`` alternating timings (every product timed once a round, in turn, so a slow
moment falls on all of them). ``mkl`` is ``F.linear`` (MKL's sgemm for float32; oneDNN for bf16, where PyTorch sends
bf16 products); ``onednn`` is oneDNN's matmul on weights packed once (the engine's normal decode step,
modeling/packed_weights.py) at decode shapes and on the plain weight at training shapes; ``invariant`` is ours,
whose every element is one fixed-order dot (kernels/csrc/lanes.h) whatever the rows, columns and threads.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.nn.functional as F

from support_replay.kernels import build, invariant
from support_replay.modeling.linear_kernels import onednn_available, onednn_linear
from support_replay.modeling.packed_weights import pack_weight, packed_linear

SHAPES = {  # SmolLM2-135M: (out, in)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def products(dtype: torch.dtype, decode: bool):
    """name -> ``f(x, w, packed)`` of the products compared."""
    out = {"mkl": lambda x, w, p: F.linear(x, w), "invariant": lambda x, w, p: invariant.linear(x, w)}
    if onednn_available():
        if decode:
            out["onednn"] = lambda x, w, p: packed_linear(x, p)
        elif dtype == torch.float32:
            out["onednn"] = lambda x, w, p: onednn_linear(x, w)
    return out


def time_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(rows: int, dtype: torch.dtype, rounds: int, decode: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    table = {}
    for name, (out_features, in_features) in SHAPES.items():
        if not decode and name == "head":
            continue  # the trainer's head reads the support's rows only (the sparse head)
        w = torch.randn(out_features, in_features, generator=gen).to(dtype)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        packed = pack_weight(w) if decode and onednn_available() else None
        runs = products(dtype, decode)
        flops = 2 * rows * out_features * in_features
        calls = max(1, int(2e8 // flops))
        for fn in runs.values():
            fn(x, w, packed)  # the first call picks its kernels
        times = {k: [] for k in runs}
        for _ in range(rounds):
            for k, fn in runs.items():
                times[k].append(time_call(lambda: fn(x, w, packed), calls))
        table[name] = {k: flops / statistics.median(v) / 1e9 for k, v in times.items()}
    return table


def print_table(title: str, table: dict) -> None:
    kinds = ["mkl", "onednn", "invariant"]
    print(f"\n{title}\n")
    print("| layer | " + " | ".join(f"{k} GFLOP/s" for k in kinds) + " | invariant / best vendor |")
    print("|---|" + "---:|" * (len(kinds) + 1))
    for name, row in table.items():
        vendor = max(v for k, v in row.items() if k != "invariant")
        cells = " | ".join(f"{row[k]:.1f}" if k in row else "-" for k in kinds)
        print(f"| {name} | {cells} | {row['invariant'] / vendor:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-rows", type=int, default=16, help="a decode step's batch (the GRPO shape's 16 samples)")
    ap.add_argument("--train-rows", type=int, default=2048, help="a packed micro-batch's tokens")
    args = ap.parse_args()
    print(
        f"{build.cpu_name()}, torch {torch.__version__} (ISA {torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads, {datetime.date.today()}; invariant: {invariant.identity()}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        print_table(
            f"decode, {args.decode_rows} rows, {name}", measure(args.decode_rows, dtype, args.rounds, decode=True)
        )
        print_table(f"train, {args.train_rows} rows, {name}", measure(args.train_rows, dtype, args.rounds, False))


if __name__ == "__main__":
    main()
