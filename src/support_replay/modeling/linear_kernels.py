"""The product every linear layer of the engine and of the trainer's forward runs through.

``torch``: ``F.linear`` as PyTorch dispatches it (MKL's sgemm for fp32 on a CPU, oneDNN for
bf16, cuBLAS on a GPU). ``onednn``: oneDNN's matmul for fp32 on a CPU, through the op
PyTorch's own compiler emits for it (``torch.ops.mkldnn._linear_pointwise``). On this
project's CPU it takes 0.65x the time of MKL at the 8-32 rows of a decode step (measured:
docs/benchmarks.md). Whether a kernel's rows keep their bits whatever the row count depends on
the CPU; true-on-policy mode does not use either (kernels/invariant.py). Its results differ from MKL's in the last
bits.
``auto`` takes, for fp32 on a CPU where PyTorch has oneDNN, whichever of the two a probe measured faster on
this machine (modeling/kernel_probe.py, kept per machine so every process agrees), else ``torch``: for the
engine at a decode step's rows, for a trainer's forward (outside true-on-policy mode) at a micro-batch's. The trainer's
backward stays plain products (``_OneDNNLinear``): only the forward's bits are promised.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "torch", "onednn")


def bf16_instructions() -> bool:
    """Whether this CPU has the bf16 instructions oneDNN's bf16 products need (PyTorch's own check)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16(dtype: torch.dtype, device) -> str | None:
    """Why bf16 compute is slow on ``device`` (None where it is not): on a CPU without bf16 instructions PyTorch's
    bf16 products leave oneDNN for ATen's portable GEMM (measured: docs/benchmarks.md, an AMD EPYC without
    AVX-512, a GRPO step 8x float32's)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or bf16_instructions():
        return None
    return (
        "this CPU has no bf16 instructions, so PyTorch's bf16 products run its portable GEMM: a GRPO step took 8x "
        "float32's time on such a CPU (docs/benchmarks.md); float32 is faster here"
    )


LINEAR_KERNEL_HELP = (
    "the linear-layer product of the engine and of the trainer's forward outside true-on-policy mode (which runs its "
    "own invariant product): onednn (fp32 on a CPU, 0.65x MKL's time at decode sizes on an AMD EPYC), torch "
    "(F.linear), auto (the faster of the two on this machine, measured once for the engine's decode rows and for "
    "the trainer's micro-batch rows; bf16 and tensor-parallel layers take torch)"
)


@functools.cache
def onednn_available() -> bool:
    """PyTorch has oneDNN's linear op and it computes a linear layer (checked once on a small product)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = (
            torch.randn(16, 32, generator=torch.Generator().manual_seed(0)),
            torch.randn(24, 32, generator=torch.Generator().manual_seed(1)),
        )
        return bool(torch.allclose(op(x, w, None, "none", [None], ""), F.linear(x, w), rtol=1e-5, atol=1e-5))
    except RuntimeError:
        return False


def resolve_linear_kernel(
    name: str, dtype: torch.dtype, device: str | torch.device = "cpu", use: str = "decode"
) -> str:
    """``auto`` made concrete for weights of ``dtype`` on ``device`` and for ``use`` (the engine's ``decode``, or
    ``train``: a trainer's forward outside true-on-policy mode, measured at its own row counts);
    ``onednn`` where it cannot run is refused."""
    from ..errors import ConfigError

    if name not in KERNELS:
        raise ConfigError(f"linear_kernel: {name!r} is not one of {list(KERNELS)}")
    usable = torch.device(device).type == "cpu" and dtype == torch.float32 and onednn_available()
    if name == "auto":
        if not usable:
            return "torch"
        from .kernel_probe import probed_kernel

        return probed_kernel(use)  # the faster of the two on this machine, measured once (modeling/kernel_probe.py)
    if name == "onednn" and not usable:
        raise ConfigError(
            f"linear_kernel: 'onednn' runs fp32 on a CPU with PyTorch's oneDNN ops (here: {dtype} on {device}, "
            f"oneDNN {'present' if onednn_available() else 'absent'})"
        )
    return name


class _OneDNNLinear(torch.autograd.Function):
    """oneDNN's forward; the backward as plain products (only the forward's bits are promised)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")

    @staticmethod
    def backward(ctx, grad):
        from ..kernels.invariant import linear_grads

        return linear_grads(ctx, grad)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def linear_function(kernel: str) -> Callable:
    """``f(x, weight, bias)`` of a resolved kernel name (``invariant``: true-on-policy mode's, kernels/invariant.py)."""
    from ..kernels import invariant

    return {"torch": F.linear, "onednn": onednn_linear, "invariant": invariant.linear}[kernel]


def use_linear(model: nn.Module, linear: Callable) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` computes ``linear(x, weight, bias)`` (in place; the module
    stays an ``nn.Linear``, hooks and parameters unchanged); ``model_linear(model)`` returns it."""
    model.__dict__["_support_replay_linear"] = linear  # a plain attribute: never in a state dict or config
    if linear is F.linear:
        return model

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(forward, module)
    return model


def model_linear(model: nn.Module) -> Callable:
    """The product ``model``'s linear layers run through (``F.linear`` unless ``use_linear`` set one)."""
    return model.__dict__.get("_support_replay_linear", F.linear)


def model_kernel(model: nn.Module) -> str | None:
    """The kernel behind ``model_linear(model)``: 'torch', 'onednn', 'invariant', or None for another product."""
    linear = model_linear(model)
    from ..kernels import invariant

    if getattr(linear, "kernel", None) == "invariant" or linear is invariant.linear:
        return "invariant"
    return {F.linear: "torch", onednn_linear: "onednn"}.get(linear)
