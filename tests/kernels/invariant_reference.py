"""The order of the invariant arithmetic's dot (kernels/csrc/lanes.h), written out in NumPy with every rounding
exact: the reference its kernels are compared with bit for bit.

``fma32(a, b, c)`` is float32's fused multiply-add, correctly rounded: the product of two float32 values is exact in
float64, the sum's error is found exactly (TwoSum), and the float64 sum is rounded to odd before it is rounded to
float32, which makes the double rounding exact (a rounding to odd in 53 bits, then to nearest in 24, is the
rounding to nearest of the exact value). The portable build has no vector fused multiply-add: there a product and a
sum round apart (``fused=False``)."""

from __future__ import annotations

import numpy as np
import torch

from support_replay.kernels import build


def lanes_of_this_build() -> tuple[int, bool]:
    """``(W, fused)``: the float lanes of this build's vectors and whether its multiply-adds are fused."""
    isa = build._isa()[0]
    return {"avx512": 16, "avx2": 8, "default": 8}[isa], isa != "default"


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    error = (p - (s - bb)) + (c64 - bb)  # exact (TwoSum)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((error != 0) & even, np.nextafter(s, np.where(error > 0, np.inf, -np.inf)), s)  # round to odd
    return s.astype(np.float32)


def multiply_add(a, b, c, fused: bool) -> np.ndarray:
    if fused:
        return fma32(a, b, c)
    return (a.astype(np.float32) * b.astype(np.float32)).astype(np.float32) + c


def fold(lanes: np.ndarray) -> np.ndarray:
    """The lanes (last axis) added halves first: lane k + lane k + W/2, the same on the first half, to one."""
    lanes = lanes.copy()
    half = lanes.shape[-1] // 2
    while half >= 1:
        lanes[..., :half] = lanes[..., :half] + lanes[..., half : 2 * half]
        half //= 2
    return lanes[..., 0]


def dots(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: every dot of a row of ``x`` ``[M, K]`` with a row of ``w`` ``[N, K]`` in the stated order: W lanes,
    lane l a chain over k = l, l + W, ... from +0, then ``fold``."""
    width, fused = lanes_of_this_build()
    x, w = x.float().numpy(), w.float().numpy()
    m, k_size = x.shape
    n = w.shape[0]
    lanes = np.zeros((m, n, width), np.float32)
    for k in range(k_size):
        a = np.broadcast_to(x[:, None, k], (m, n))
        b = np.broadcast_to(w[None, :, k], (m, n))
        lanes[:, :, k % width] = multiply_add(a, b, lanes[:, :, k % width], fused)
    return torch.from_numpy(fold(lanes))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in the kernel's order: the sum of squares a dot of the row with itself, mean = sum / n, then
    ``1 / sqrt(mean + eps)``, ``x * that`` rounded to x's dtype, times the weight in that dtype."""
    rows = x.reshape(-1, x.shape[-1])
    total = torch.diagonal(dots(rows, rows)).numpy()
    mean = total / np.float32(x.shape[-1])
    inverse = np.float32(1) / np.sqrt((mean + np.float32(eps)).astype(np.float32))
    normed = torch.from_numpy((rows.float().numpy() * inverse[:, None]).astype(np.float32)).to(x.dtype)
    return (weight.to(x.dtype).float() * normed.float()).to(x.dtype).reshape(x.shape)
