"""oneDNN's fp32 product over weights packed once into the layout its kernel reads.

``torch.ops.mkldnn._linear_pointwise`` given a plain ``[out, in]`` weight reorders it into
oneDNN's blocked layout on every call: a decode step of a small batch pays a pass over all its
weights for the reorder beside the product itself. ``pack_weight`` does that reorder once
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's own compiler emits when it
freezes a model's weights) and ``packed_linear`` runs the same product on the packed copy.
Measured on this project's CPU (docs/benchmarks.md): SmolLM2's decode step at batch 16 in 0.75x
the time, and the same bits as the plain weight for 2 rows or more; one row takes another
kernel, so callers keep the plain weight there. ``packing_keeps_bits`` checks the bits for one
weight shape at the current thread count before any packed product is trusted.

A packed copy is an opaque oneDNN tensor: it costs one more copy of the weights and does not
see later writes to the plain weight; its owner repacks after an update (engine/fused_step.py).
"""

from __future__ import annotations

import functools

import torch

from .linear_kernels import onednn_available

PACK_ROWS = 16  # the row count oneDNN picks the packed layout for: a decode step's batch
PROBE_ROWS = (2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 64, 100)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (fp32, CPU) reordered into oneDNN's layout for products of ``PACK_ROWS`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over a ``pack_weight`` copy (no autograd: the engine's forward only)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


@functools.cache
def packing_keeps_bits(out_features: int, in_features: int, threads: int) -> bool:
    """Every row of a packed product is the plain oneDNN product's bits, for ``PROBE_ROWS`` row counts
    of random data on a weight of this shape (``threads``: the thread count it was checked at, a cache key)."""
    if not onednn_available():
        return False
    gen = torch.Generator().manual_seed(out_features * 8191 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    try:
        packed = pack_weight(weight)
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            plain = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")
            if not torch.equal(packed_linear(x, packed), plain):
                return False
    except RuntimeError:  # a oneDNN build without the reorder op or this layout
        return False
    return True
