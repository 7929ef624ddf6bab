"""True-on-policy mode's arithmetic: products, norms, activations, softmax, rotary angles and attention whose every
output element follows one order that this project's code fixes (csrc/lanes.h, csrc/invariant_*.cpp,
csrc/decode_attention.cpp), with autograd.

Each element is one dot of ``lanes.h`` (W lanes of fused multiply-adds, folded by one fixed tree) or one row's
function; nothing depends on the other rows of the call, the columns beside it, the strides, the tiles or the
thread count. So the engine's decode step, its prefill and the trainer's forward give a token the same bits, by
construction, on any CPU and under any of ATen's kernel sets (``ATEN_CPU_CAPABILITY``, MKL's and oneDNN's ISA caps):
none of this goes through a vendor library. What the build's vector width is (16 floats with AVX-512, 8 with AVX2
and in the portable build) is part of the order, so both sides of a run use one build (``identity()``; a remote
engine reports its own, the trainer compares).

The backward passes are PyTorch's operations on the saved inputs: deterministic at a fixed layout, not bit-matched
to anything (only the forward's bits are promised). bf16 inputs are read as float32, every sum is float32, and each
result is rounded once to the input's dtype where the models round it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from ..errors import ConfigError
from . import build


@functools.cache
def _module() -> ModuleType:
    module, why = build.built()
    if module is None:
        raise ConfigError(f"true-on-policy mode runs this project's compiled CPU kernels, which are not here: {why}")
    return module


def available() -> str | None:
    """Why the invariant arithmetic cannot run here (None when it can: the kernels built)."""
    module, why = build.built()
    return None if module is not None else why


def identity() -> str:
    """What the bits of this arithmetic depend on besides the inputs: the build's vector ISA and its sources' digest
    (the extension's name). Two processes with one identity compute the same bits."""
    return _module().__name__


def _grad_enabled(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- the product --------------------------------------------------------------------------------------------------


def linear_grads(ctx, grad):
    """``(grad_x, grad_weight, grad_bias)`` of ``x @ weight.T + bias`` by plain products: the backward of a linear
    forward whose own bits are promised (this one's, or oneDNN's: modeling/linear_kernels.py). ``ctx`` saved
    ``(x, weight)`` and ``has_bias``."""
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = (rows @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _module().invariant_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return linear_grads(ctx, grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (float32 or bf16, x's dtype; the weight and bias cast to it), every element one dot of
    ``lanes.h`` in float32 plus its bias, rounded once."""
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if _grad_enabled(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    return _module().invariant_linear(x, weight, bias)


class _Dots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ids, counts):
        ctx.save_for_backward(x, weight, ids, counts)
        return _module().invariant_dots(x, weight, ids, counts)

    @staticmethod
    def backward(ctx, grad):
        x, weight, ids, counts = ctx.saved_tensors
        valid = torch.arange(ids.shape[1], device=ids.device)[None] < counts[:, None]
        g = grad.masked_fill(~valid, 0).to(torch.float32)
        safe = ids.masked_fill(~valid, 0)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.einsum("tj,tjh->th", g, weight[safe].to(torch.float32)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            outer = g[:, :, None] * x.to(torch.float32)[:, None, :]
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            grad_w.index_add_(0, safe.reshape(-1), outer.reshape(-1, x.shape[1]))
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def dots(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[T, J]``: ``x[t] . weight[ids[t, j]]`` for the valid ids of each row (a row's valid ids first), each the
    element ``linear(x, weight)[t, ids[t, j]]`` would be, the same bits; 0 at invalid entries (the sparse head)."""
    weight = weight.to(x.dtype)
    counts = valid.sum(-1)
    if not bool((valid == (torch.arange(ids.shape[1], device=ids.device)[None] < counts[:, None])).all()):
        raise ValueError("dots: each row's valid ids must come first")
    ids = ids.to(torch.long)
    if _grad_enabled(x, weight):
        return _Dots.apply(x, weight, ids, counts)
    return _module().invariant_dots(x, weight, ids, counts)


# ---- the rows: RMSNorm, SiLU x up, softmax, rotary angles ---------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, inverse = _module().invariant_rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, inverse)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, inverse = ctx.saved_tensors
        x32, g = x.to(torch.float32), grad.to(torch.float32)
        normed = x32 * inverse[..., None]
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gn = g * weight.to(torch.float32)
            grad_x = (inverse[..., None] * (gn - normed * (gn * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's and Qwen3's RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``) with the sum of squares one
    dot of ``lanes.h``; the weight cast to x's dtype."""
    weight = weight.to(x.dtype)
    if _grad_enabled(x, weight):
        return _RMSNorm.apply(x, weight, float(eps))
    return _module().invariant_rms_norm(x, weight, float(eps))[0]


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _module().invariant_silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, u, d = gate.to(torch.float32), up.to(torch.float32), grad.to(torch.float32)
        sigmoid = torch.sigmoid(g)
        grad_gate = (d * u * sigmoid * (1 + g * (1 - sigmoid))).to(gate.dtype)
        return grad_gate, (d * g * sigmoid).to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, each element by one function whatever the tensor's length (ATen's scalar tail differs)."""
    if _grad_enabled(gate, up):
        return _SiluMul.apply(gate, up)
    return _module().invariant_silu_mul(gate, up)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = _module().invariant_softmax(x)
        ctx.save_for_backward(out)
        ctx.dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        return (p * (grad - (grad * p).sum(-1, keepdim=True))).to(ctx.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last dimension, each row's sum in a fixed order (a router's probabilities)."""
    if _grad_enabled(x):
        return _Softmax.apply(x)
    return _module().invariant_softmax(x)


def rotary(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[..., 2 len(inv_freq)]`` float32 of ``positions``, as the models' rotary embeddings compute
    them (position x frequency, the halves repeated, times ``scaling``), each element by one function."""
    return _module().invariant_rotary(inv_freq.to(torch.float32), positions, float(scaling))


# ---- attention ----------------------------------------------------------------------------------------------------

ATTENTION_CHUNK = 1 << 26  # score elements the backward recomputes at a time ([rows, heads, queries, keys])


def _allowed(mask: torch.Tensor | None, shape: tuple) -> torch.Tensor:
    """The boolean ``[B, 1|H, Lq, L]`` of which keys each query sees."""
    batch, heads, q_len, width = shape
    if mask is None:
        return torch.ones(batch, 1, q_len, width, dtype=torch.bool)
    return mask if mask.dtype == torch.bool else mask == 0


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _module().attention(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        batch, heads, q_len, dim = q.shape
        group = heads // k.shape[1]
        allowed = _allowed(mask, (batch, heads, q_len, k.shape[2]))
        grads = [torch.empty(t.shape, dtype=torch.float32) for t in (q, k, v)]
        per_row = heads * q_len * k.shape[2]
        step = max(1, ATTENTION_CHUNK // max(1, per_row))
        for start in range(0, batch, step):
            rows = slice(start, start + step)
            qf = q[rows].to(torch.float32)
            kf = k[rows].to(torch.float32).repeat_interleave(group, 1)
            vf = v[rows].to(torch.float32).repeat_interleave(group, 1)
            seen = allowed[rows] if allowed.shape[0] > 1 else allowed
            scores = (qf @ kf.transpose(-1, -2)) * ctx.scale
            scores = scores.masked_fill(~seen, float("-inf"))
            live = seen.any(-1, keepdim=True)
            probs = torch.softmax(scores.masked_fill(~live, 0.0), -1).masked_fill(~seen, 0.0)
            d_out = grad[rows].to(torch.float32).transpose(1, 2)  # [b, H, Lq, D]
            d_probs = d_out @ vf.transpose(-1, -2)
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * ctx.scale
            grads[0][rows] = d_scores @ kf
            d_k = d_scores.transpose(-1, -2) @ qf
            d_v = probs.transpose(-1, -2) @ d_out
            grads[1][rows] = d_k.reshape(d_k.shape[0], -1, group, *d_k.shape[2:]).sum(2)
            grads[2][rows] = d_v.reshape(d_v.shape[0], -1, group, *d_v.shape[2:]).sum(2)
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[B, Lq, Hq, D]`` attention of ``q`` ``[B, Hq, Lq, D]`` over ``k``/``v`` ``[B, Hkv, L, D]`` (grouped-query
    heads), ``mask`` boolean (True: seen) or additive over ``[B, 1|Hq, Lq, L]``. Each query position's output is the
    decode kernel's for that query alone over the keys its mask row sees, taken in key order (scores a dot of
    ``lanes.h``, a softmax and weighted sum in key order): its bits do not depend on the padding, on the other rows or
    positions of the call, or on whether it is a decode step, a prefill or a trainer's packed row. A query that sees
    no key gets zeros."""
    if _grad_enabled(q, k, v):
        return _Attention.apply(q, k, v, mask, float(scale))
    return _module().attention(q, k, v, mask, float(scale))
