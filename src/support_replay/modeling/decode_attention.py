"""The engine's decode attention on a CPU: one query token per row in one compiled kernel (csrc/decode_attention.cpp).

At a decode step PyTorch's CPU attention (``scaled_dot_product_attention``'s flash kernel) costs about 5 us of wall
time per (row, key-value head) whatever the work, 14-18% of a SmolLM2 step at batch 16 (docs/benchmarks.md). The
kernel here does the same arithmetic in float32 (scores, softmax with ATen's vectorized exp, the weighted sum of
the values) with one task per (row, key-value head) that reads each key and value once for its group of queries.
It is built once per machine with the project's other CPU kernels (modeling/build.py), for the vector ISA
PyTorch itself runs at, and kept in the user cache; each process checks it against sdpa on a few shapes before
using it.

The engine takes it through the model's attention interface (``ATTENTION``, registered with transformers), so the
module-tree decode and the fused step call the same function and keep the same bits. Only one-token queries
without gradients, dropout, sliding windows, soft caps or sinks take the kernel; everything else (prefills, the
trainer) is sdpa's, as before. A row's output does not depend on the other rows, the padding or the thread count
(a task's arithmetic is fixed and masked keys are skipped). Its bits differ from sdpa's in the last places, like
any other kernel's; a true-on-policy engine keeps its batch-invariant attention instead.

``--decode-attention``: ``auto`` (the kernel where it builds and passes the check, else sdpa, saying why once),
``kernel`` (refused with the reason where it cannot run), ``sdpa`` (the model's own).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
from torch import nn

from ..kernels import build

log = logging.getLogger(__name__)

ATTENTION = "support_replay_decode"
CHOICES = ("auto", "kernel", "sdpa")
HELP = (
    "the engine's decode attention on a CPU: kernel (one compiled float32 kernel per step and layer, built once per "
    "machine; about half sdpa's time at a SmolLM2 fp32 decode step), sdpa (the model's own), auto (the kernel where it "
    "builds and agrees with sdpa, else sdpa)"
)
DTYPES = (torch.float32, torch.bfloat16)
# the kernel against sdpa on the check's shapes: float32 within rounding, bf16 within one rounding of its output
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# keyword arguments whose attention the kernel does not compute: such calls stay on sdpa
UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


@functools.cache
def compiled() -> tuple[ModuleType | None, str]:
    """The project's CPU kernels (modeling/build.py) with this one checked against sdpa, or None and why
    it cannot run."""
    return build.checked(lambda module: check(module.decode_attention))


def check(kernel) -> str:
    """Where ``kernel`` and sdpa disagree beyond rounding on a few decode shapes ("" when nowhere)."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    cases = [(1, 4, 4, 7, 64), (5, 9, 3, 40, 64), (3, 8, 2, 33, 128), (2, 6, 1, 17, 80)]
    for dtype in DTYPES:
        for rows, heads, kv_heads, width, dim in cases:
            q = torch.randn(rows, 1, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # as a model's view
            k, v = (torch.randn(rows, kv_heads, width + 3, dim, generator=generator).to(dtype) for _ in range(2))
            k, v = k[:, :, :width], v[:, :, :width]  # strided, as the paged cache's views
            seen = torch.arange(width)[None] < torch.randint(1, width + 1, (rows, 1), generator=generator)
            additive = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))
            for mask in (seen[:, None, None], additive[:, None, None]):
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
                got = kernel(q, k, v, mask, dim**-0.5)
                error = (got.float() - want.transpose(1, 2).float()).abs().max().item()
                if not error <= TOLERANCE[dtype]:
                    return (
                        f"it disagrees with sdpa by {error:.2e} (over {TOLERANCE[dtype]:g}) at {dtype}, "
                        f"{rows} rows, {heads}/{kv_heads} heads, width {width}, head size {dim}, {mask.dtype} mask"
                    )
    return ""


def takes_kernel(query, key, value, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether this attention call is one the kernel computes (else it is sdpa's)."""
    if query.shape[2] != 1 or dropout or query.device.type != "cpu" or query.dtype not in DTYPES:
        return False
    if not (query.dtype == key.dtype == value.dtype) or not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        return False
    if key.shape != value.shape or key.shape[0] != query.shape[0]:
        return False
    if query.shape[1] % key.shape[1] or any(kwargs.get(name) is not None for name in UNSUPPORTED_KWARGS):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[2] != 1 or attention_mask.shape[3] != key.shape[2]:
            return False
        if attention_mask.dtype not in (torch.bool, torch.float32, torch.bfloat16):
            return False
    return query.stride(-1) == key.stride(-1) == value.stride(-1) == 1


def decode_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``[rows, heads, 1, dim]`` queries to ``[rows, 1, heads, dim]``."""
    kernel, _ = compiled()
    if kernel is not None and takes_kernel(query, key, value, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel.decode_attention(query, key, value, attention_mask, float(scale)), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def use_decode_attention(model: nn.Module, choice: str = "auto") -> str:
    """The engine model's decode attention for ``choice``, in place: ``"kernel"`` or ``"sdpa"`` (what it took).
    Only a model on sdpa changes; ``kernel`` where it cannot run is refused with the reason."""
    from ..errors import ConfigError

    if choice not in CHOICES:
        raise ConfigError(f"decode_attention: {choice!r} is not one of {list(CHOICES)}")
    implementation = model.config._attn_implementation
    if implementation not in ("sdpa", ATTENTION):
        if choice == "kernel":
            raise ConfigError(
                f"decode_attention: 'kernel' needs a model on sdpa attention, this one is on {implementation!r}"
            )
        return implementation
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    kernel, why = (None, "sdpa was asked for") if choice == "sdpa" else compiled()
    if kernel is not None and not on_cpu:
        kernel, why = None, "the model is not on a CPU"
    if kernel is None:
        if choice == "kernel":
            raise ConfigError(f"decode_attention: 'kernel' cannot run here: {why}")
        if choice == "auto":
            log.info("decode attention: sdpa (the CPU kernel is not used: %s)", why)
        if implementation == ATTENTION:
            model.set_attn_implementation("sdpa")
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return "kernel"


if __name__ == "__main__":  # python -m support_replay.modeling.decode_attention: build it now, say what runs
    module, reason = compiled()
    print(f"decode attention kernel: {module.__file__}" if module is not None else f"decode attention: sdpa ({reason})")
