"""The elementwise work around a decode step's products, compiled (csrc/decode_layer.cpp), with the model's bits.

Between its products a SmolLM2 decode layer runs some 35 small PyTorch operations (two RMSNorms of seven each,
the rotary embedding of queries and keys, the cache writes, SiLU x up, the residual adds, splits and views), each
a few microseconds of dispatch for a few thousand floats: 13-17 ms of a 75 ms step at batch 16 in float32
(docs/benchmarks.md). The kernels here do that work in four calls a layer, rounding each result where the model's
own operations round it, so the fused step (engine/fused_step.py) keeps the module tree's bits. ``compiled()``
checks that on this CPU against the models' own classes and functions (``torch.equal``) before anything uses it;
where it does not hold, or the kernels do not build, the step keeps PyTorch's operations.

The RMSNorm's mean and SiLU are the two places where rounding in the model's order takes more than one operation
after another. The kernels compute them in their own loops written in ATen's order (its cascade sum, its
vectorized SiLU): at a decode step ATen's calls from C++ cost two to three times their standalone time, each
product leaving ATen's code and data cold (the residual add + norm took 37 us a call in a SmolLM2 step, 14 with
the loops). The check compares the loops with ATen over widths from 1 to 70000 first (``MEAN_WIDTHS``); where
they differ (another PyTorch, another CPU's vectors) the kernels call ATen's own kernels instead, as before.

Float32 only: a bf16 step keeps PyTorch's operations (each of them rounds to bf16, which these kernels do not).
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from ..kernels import build

log = logging.getLogger(__name__)

# the modules and functions whose arithmetic the kernels repeat, by model family (checked bit for bit at start-up)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
}
# rows, query heads, key-value heads, head size, hidden size, epsilon
CHECK_CASES = [(1, 4, 2, 64, 96, 1e-5), (5, 9, 3, 64, 576, 1e-6), (16, 8, 8, 128, 1000, 1e-6), (3, 2, 1, 80, 200, 1e-5)]
# the widths the mean of squares is checked at: the short rows, tails of every vector width, the models' hidden sizes
# and head sizes, and rows long enough for each level of ATen's cascade sum
MEAN_WIDTHS = [*range(1, 70), 96, 128, 200, 256, 576, 896, 1000, 1024, 1536, 2048, 2049, 2560, 3584, 4096, 5120, 8192]
MEAN_WIDTHS += [16400, 70000]
SILU_WIDTHS = [1, 7, 17, 33, 100, 1537]


@functools.cache
def compiled() -> tuple[ModuleType | None, str]:
    """The project's CPU kernels with these checked against the models' own operations, or None and why not."""
    return build.checked(_choose_arithmetic)


def _choose_arithmetic(kernels) -> str:
    """The kernels' own loops for the RMSNorm's mean and SiLU where they keep the models' bits here, else ATen's
    calls; "" where either does, else where ATen's calls disagree."""
    kernels.use_aten_calls(False)
    disagreement = check(kernels)
    if not disagreement:
        return ""
    log.info("decode layer: the mean and SiLU call ATen's kernels (the loops in their order differ: %s)", disagreement)
    kernels.use_aten_calls(True)
    return check(kernels)


def _family(name: str):
    module_name, norm = FAMILIES[name]
    module = importlib.import_module(module_name)
    return getattr(module, norm), module.apply_rotary_pos_emb


def check(kernels) -> str:
    """Where the kernels' bits differ from the models' own operations on a few decode shapes ("" nowhere)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    with torch.inference_mode():
        for width in MEAN_WIDTHS:
            for scale in (1e-3, 1.0, 1e3):
                x = randn(3, width) * scale
                if not torch.equal(kernels.mean_of_squares(x), x.pow(2).mean(-1, keepdim=True)):
                    return f"its mean of squares differs from PyTorch's at width {width} (scale {scale})"
        for width in SILU_WIDTHS:
            gate_up = randn(3, 1, 2 * width) * 4
            gate, up = gate_up.split(width, dim=-1)
            if not torch.equal(kernels.silu_mul(gate_up, width), F.silu(gate) * up):
                return f"its SiLU x up differs from PyTorch's at width {width}"
    for family in FAMILIES:
        norm_class, rope = _family(family)
        for rows, heads, kv_heads, dim, hidden, eps in CHECK_CASES:
            norm = norm_class(hidden, eps=eps)
            head_norm = norm_class(dim, eps=eps)
            with torch.no_grad():
                norm.weight.copy_(randn(hidden))
                head_norm.weight.copy_(randn(dim))
            x, update = randn(rows, 1, hidden) * 3, randn(rows, 1, hidden)
            with torch.inference_mode():
                if not torch.equal(kernels.rms_norm(x, norm.weight, eps), norm(x)):
                    return f"its RMSNorm differs from {norm_class.__name__}'s at {rows} x {hidden}"
                total, normed = kernels.add_rms_norm(x, update, norm.weight, eps)
                if not (torch.equal(total, x + update) and torch.equal(normed, norm(x + update))):
                    return f"its residual add and RMSNorm differ from {norm_class.__name__}'s at {rows} x {hidden}"
                gate_up = randn(rows, 1, 2 * hidden) * 4
                gate, up = gate_up.split(hidden, dim=-1)
                if not torch.equal(kernels.silu_mul(gate_up, hidden), F.silu(gate) * up):
                    return f"its SiLU x up differs from PyTorch's at {rows} x {hidden}"
                disagreement = _check_attention_inputs(kernels, rope, head_norm, rows, heads, kv_heads, dim, generator)
                if disagreement:
                    return f"{family}: {disagreement}"
    return ""


def _check_attention_inputs(kernels, rope, head_norm, rows, heads, kv_heads, dim, generator) -> str:
    qkv = torch.randn(rows, 1, (heads + 2 * kv_heads) * dim, generator=generator)
    angles = torch.randn(rows, 1, dim // 2, generator=generator) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(rows + 7, generator=generator)[:rows]
    for norms in (False, True):
        q, k, v = (t.view(rows, 1, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        if norms:
            q, k = head_norm(q), head_norm(k)
        want_q, want_k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        caches = torch.zeros(2, kv_heads, rows + 7, dim)
        weight = head_norm.weight if norms else None
        got = kernels.attention_inputs(
            qkv, heads, kv_heads, dim, cos, sin, weight, weight, head_norm.variance_epsilon, caches[0], caches[1], slots
        )
        if not torch.equal(got, want_q):
            return f"its rotated queries differ from the model's ({rows} rows, {heads} heads of {dim}, norms {norms})"
        if not torch.equal(caches[0][:, slots], want_k[:, :, 0].transpose(0, 1)):
            return f"its rotated keys differ from the model's ({rows} rows, {kv_heads} heads of {dim}, norms {norms})"
        if not torch.equal(caches[1][:, slots], v.transpose(1, 2)[:, :, 0].transpose(0, 1)):
            return f"its cached values differ from the product's ({rows} rows, {kv_heads} heads of {dim})"
    return ""


def unsupported(model) -> str | None:
    """Why the kernels cannot stand in for ``model``'s own operations at a decode step (None when they can)."""
    family = model.config.model_type
    if family not in FAMILIES:
        return f"model type {family!r}"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return "the model is not float32 on a CPU"
    norm_class, rope = _family(family)
    attention_module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    if attention_module.apply_rotary_pos_emb is not rope:
        return "the model's rotary embedding is not its family's"
    norms = [model.model.norm]
    for layer in model.model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        attention = layer.self_attn
        if hasattr(attention, "q_norm") and attention.q_norm.variance_epsilon != attention.k_norm.variance_epsilon:
            return "the query and key norms' epsilons differ"
        norms += [getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)]
    for norm in norms:
        if type(norm) is not norm_class or "forward" in vars(norm):
            return f"a norm is {type(norm).__name__}, not {norm_class.__name__} as the kernels compute it"
    _, why = compiled()
    return why or None
