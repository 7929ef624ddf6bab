"""Linear products whose rows keep their bits whatever the row count: probed on this CPU, never assumed.

True-on-policy mode needs a row of a linear layer to get the same bits in the engine (a decode
step of a few rows, a prefill) and in the trainer (thousands of packed rows). Whether a kernel
gives that depends on the CPU and the BLAS: on AMD EPYC with AVX-512, MKL's fp32 rows are
invariant once the count is a multiple of 16 and oneDNN's from 2 rows; with MKL limited to AVX2
on an Intel Xeon they are not (the count changes the reduction). So the plan for each weight
shape is found by a probe at first use (cached per kernel, shape, dtype and thread count):

- ``pad R``: rows zero-padded to a multiple of R, one product (the fast plan), for the first R of
  ``PAD_CANDIDATES`` whose rows keep their bits at every probed count and offset;
- ``tiles T``: every product exactly T rows (the last tile zero-padded), so the row count cannot
  reach the kernel at all; taken where no padding works, if each row keeps its bits wherever it
  sits in a tile;
- none: true-on-policy mode is refused by name at start-up (``require_invariant``).

``columns`` says whether a product over a subset of the weight's rows (output columns) gives the
full product's bits at those columns, which the trainer's union head relies on; where it does
not, the trainer scores through the full head instead (train/actor.py).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NoInvariantProduct

PAD_CANDIDATES = {"onednn": (2, 16, 64), "torch": (16, 32, 64)}
TILE_CANDIDATES = (16, 64)
PROBE_COUNTS = (1, 2, 3, 5, 15, 16, 17, 31, 33, 64, 100, 257)  # rows of the probed products
PROBE_ROWS = 320  # the reference product's rows; each probed count is cut from it at three offsets
COLUMN_COUNTS = (16, 17, 100, 333)  # output columns of the probed column subsets (the union head's products)


@dataclass(frozen=True)
class InvariantPlan:
    rows: int  # pad to a multiple of this, or the tile's row count
    tiled: bool  # every product exactly ``rows`` rows
    columns: bool  # a subset of output columns keeps the full product's bits

    def describe(self) -> str:
        return f"{'tiles' if self.tiled else 'pad'} {self.rows}" + ("" if self.columns else ", full head")


def padded(linear: Callable, rows: int) -> Callable:
    """``linear`` over row counts padded to a multiple of ``rows`` (zeros) in one product."""

    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        extra = -flat.shape[0] % rows
        if extra:
            flat = torch.cat([flat, flat.new_zeros(extra, flat.shape[1])])
        out = linear(flat, weight, bias)
        return out[: out.shape[0] - extra].reshape(*x.shape[:-1], out.shape[-1])

    product.unpadded = linear  # what ``model_kernel`` names
    return product


def tiled(linear: Callable, rows: int) -> Callable:
    """``linear`` as products of exactly ``rows`` rows each (the last tile zero-padded)."""

    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        count = flat.shape[0]
        extra = -count % rows
        if extra:
            flat = torch.cat([flat, flat.new_zeros(extra, flat.shape[1])])
        out = torch.cat([linear(tile, weight, bias) for tile in flat.split(rows)])
        return out[:count].reshape(*x.shape[:-1], out.shape[-1])

    product.unpadded = linear
    return product


def _rows_keep_their_bits(product: Callable, weight: torch.Tensor, data: torch.Tensor) -> bool:
    reference = product(data, weight)
    for count in PROBE_COUNTS:
        for at in (0, 7, PROBE_ROWS - count):
            if not torch.equal(product(data[at : at + count], weight), reference[at : at + count]):
                return False
    return True


def _columns_keep_their_bits(product: Callable, weight: torch.Tensor, data: torch.Tensor, gen: torch.Generator) -> bool:
    rows = data[:37]
    full = product(rows, weight)
    for count in COLUMN_COUNTS:
        if count > weight.shape[0]:
            continue
        columns = torch.randperm(weight.shape[0], generator=gen)[:count].sort().values
        if not torch.equal(product(rows, weight[columns]), full[:, columns]):
            return False
    return True


def probe_plan(
    linear: Callable,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    pads=(16, 32, 64),
    tiles=TILE_CANDIDATES,
    seed: int = 0,
) -> InvariantPlan | None:
    """The first plan under which ``linear``'s rows keep their bits for a ``[out, in]`` weight of
    ``dtype`` (random data; ``seed`` varies it), or None where neither padding nor tiling does."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + out_features * 8191 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    data = torch.randn(PROBE_ROWS, in_features, generator=gen).to(dtype)
    with torch.no_grad():
        for make, candidates in ((padded, pads), (tiled, tiles)):
            for rows in candidates:
                product = make(linear, rows)
                if _rows_keep_their_bits(product, weight, data):
                    return InvariantPlan(rows, make is tiled, _columns_keep_their_bits(product, weight, data, gen))
    return None


@functools.cache
def invariant_plan(
    kernel: str, out_features: int, in_features: int, dtype: torch.dtype, threads: int
) -> InvariantPlan | None:
    """``probe_plan`` for a resolved kernel name (linear_kernels.py), cached; ``threads`` is a cache key
    (a kernel's reduction may change with the thread count)."""
    from .linear_kernels import linear_function

    return probe_plan(linear_function(kernel), out_features, in_features, dtype, PAD_CANDIDATES[kernel])


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plan_or_refuse(kernel: str, weight: torch.Tensor) -> InvariantPlan:
    out_features, in_features = weight.shape
    plan = invariant_plan(kernel, out_features, in_features, weight.dtype, torch.get_num_threads())
    if plan is None:
        raise NoInvariantProduct(
            f"--true-on-policy-mode: no batch-invariant product for a {out_features}x{in_features} {weight.dtype} "
            "linear layer "
            f"on the {kernel!r} kernel at {torch.get_num_threads()} threads on this CPU ({cpu_name()}): neither "
            "padding rows "
            f"to {PAD_CANDIDATES[kernel]} nor tiles of {TILE_CANDIDATES} rows keep a row's bits; try `--linear-kernel "
            f"{'torch' if kernel == 'onednn' else 'onednn'}` or run without --true-on-policy-mode"
        )
    return plan


@functools.cache
def invariant_linear(kernel: str) -> Callable:
    """``f(x, weight, bias)`` on ``kernel`` under the probed plan of ``weight``'s shape (per call, cached);
    one function per kernel, so what caches by the product (packed_weights.py) probes it once."""
    from .linear_kernels import linear_function

    linear = linear_function(kernel)

    @functools.cache
    def shaped(out_features: int, in_features: int, dtype: torch.dtype, threads: int) -> Callable:
        plan = _plan_or_refuse(kernel, torch.empty(out_features, in_features, dtype=dtype, device="meta"))
        return (tiled if plan.tiled else padded)(linear, plan.rows)

    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return shaped(weight.shape[0], weight.shape[1], weight.dtype, torch.get_num_threads())(x, weight, bias)

    product.unpadded = linear
    product.kernel = kernel
    return product


@functools.cache
def fused_columns_keep_bits(
    linear: Callable, widths: tuple[int, ...], in_features: int, dtype: torch.dtype, threads: int
) -> bool:
    """Whether one product over weights stacked by rows (``widths`` output features each: a fused QKV or
    gate/up projection) gives every part the bits of its own product, at decode-step row counts."""
    gen = torch.Generator().manual_seed(sum(widths) * 8191 + in_features)
    parts = [torch.randn(w, in_features, generator=gen).to(dtype) for w in widths]
    fused = torch.cat(parts)
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 16, 17, 33, 64):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            pieces = linear(x, fused).split(list(widths), dim=-1)
            if not all(torch.equal(piece, linear(x, w)) for piece, w in zip(pieces, parts)):
                return False
    return True


def model_plans(model: nn.Module, kernel: str) -> dict[str, InvariantPlan]:
    """The plan of every linear layer's weight shape of ``model`` (``"out x in"`` -> plan); raises
    ``NoInvariantProduct`` naming the first shape without one. Run once at start-up, so a run on a
    CPU without an invariant product stops before it samples anything."""
    from .moe import moe_weights  # the sparse blocks' products: router and experts (modeling/moe.py)

    weights = [module.weight for module in model.modules() if isinstance(module, nn.Linear)]
    plans = {}
    for weight in weights + moe_weights(model):
        key = f"{weight.shape[0]}x{weight.shape[1]}"
        if key not in plans:
            plans[key] = _plan_or_refuse(kernel, weight)
    return plans


def head_columns_invariant(model: nn.Module, kernel: str) -> bool:
    """Whether the union head (a product over some vocabulary rows) gives the full head's bits here."""
    head = model.get_output_embeddings()
    return _plan_or_refuse(kernel, head.weight).columns
