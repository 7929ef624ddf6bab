"""oneDNN's product (fp32, bf16) over weights packed once into the layout its kernel reads.

``torch.ops.mkldnn._linear_pointwise`` given a plain ``[out, in]`` weight reorders it into
oneDNN's blocked layout on every call: a decode step of a small batch pays a pass over all its
weights for the reorder beside the product itself. ``pack_weight`` does that reorder once
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's own compiler emits when it
freezes a model's weights) and ``packed_linear`` runs the same product on the packed copy.
Measured on this project's CPU (docs/benchmarks.md): SmolLM2's decode step at batch 16 in 0.73x
the time. In fp32 a packed product is the plain one's bits for 2 rows or more (one row takes
another kernel); in bf16, where ``F.linear`` is oneDNN's product too, from one row. ``pack``
checks the bits against the caller's own product, for the weight's shape and dtype at the
current thread count (``packed_rows_from``), before any packed product is trusted.

A packed copy is an opaque oneDNN tensor: it costs one more copy of the weights and does not
see later writes to the plain weight; its owner repacks after an update (engine/fused_step.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .linear_kernels import onednn_available

PACK_ROWS = 16  # the row count oneDNN picks the packed layout for: a decode step's batch
PROBE_ROWS = (2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 64, 100)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (fp32 or bf16, CPU) reordered into oneDNN's layout for products of
    ``PACK_ROWS`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over a ``pack_weight`` copy (no autograd: the engine's forward only)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


class Pack(NamedTuple):
    weight: torch.Tensor  # a ``pack_weight`` copy
    rows_from: int  # products of at least this many rows take it; fewer take the plain weight


@functools.cache
def packed_rows_from(
    out_features: int, in_features: int, dtype: torch.dtype, plain: Callable, threads: int
) -> int | None:
    """The fewest rows from which every row of a packed product is ``plain(x, weight)``'s bits (1 or 2;
    None when a count of 2 or more differs), checked on random data at 1 and ``PROBE_ROWS`` rows for a
    weight of this shape and dtype (``threads``: the thread count it ran at, a cache key)."""
    if not onednn_available():
        return None
    gen = torch.Generator().manual_seed(out_features * 8191 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    try:
        packed = pack_weight(weight)
        same = {
            rows: torch.equal(packed_linear(x, packed), plain(x, weight))
            for rows in (1,) + PROBE_ROWS
            for x in [torch.randn(rows, in_features, generator=gen).to(dtype)]
        }
    except RuntimeError:  # a oneDNN build without the reorder op, this layout or this dtype
        return None
    if not all(same[rows] for rows in PROBE_ROWS):
        return None
    return 1 if same[1] else 2


def pack(weight: torch.Tensor, plain: Callable) -> Pack | None:
    """``weight`` packed for products that keep ``plain``'s bits, or None where none do."""
    rows_from = packed_rows_from(weight.shape[0], weight.shape[1], weight.dtype, plain, torch.get_num_threads())
    return None if rows_from is None else Pack(pack_weight(weight), rows_from)
