"""The sampler's top-k selection on a CPU in one compiled kernel (csrc/top_candidates.cpp).

SGLang's rule reads only the first max top_k ranks of each row's sort by (probability descending, id ascending)
(core/sampling.py). ``torch.topk`` finds them in 0.59 ms for 16 rows of SmolLM2's 49152 ids on a Zen 3 EPYC, and
its choice among tied values is arbitrary, so the sampler widens a tie at the cut with more passes. The kernel
returns exactly the sort's first ranks, ties included, in 0.08 ms (``python bench/sampling.py``). Its result is the
same tensors as ``torch.sort(probs, descending=True, stable=True)``'s first columns, so the support and the draw
are unchanged; each process checks that on a few cases (ties, NaN, -inf, tiny vocabularies) before using it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from . import cpu_kernels

log = logging.getLogger(__name__)


def _cases(generator: torch.Generator) -> list[torch.Tensor]:
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    smooth = torch.softmax(3 * randn(6, 5000), -1)
    tied = torch.softmax((3 * randn(6, 3000)).bfloat16().float(), -1)  # bf16 logits tie often at the cut
    odd = torch.softmax(randn(5, 301), -1)
    odd[0, 5] = float("nan")
    odd[1] = float("nan")
    odd[2, 100:] = 0.0
    odd[3] = 0.5
    odd[4, 7:] = float("-inf")
    few = torch.randint(0, 3, (4, 77), generator=generator).float()
    return [smooth, tied, odd, few, randn(2, 5)]


def check(kernel: Callable) -> str:
    """Where ``kernel(probs, width)`` differs from the full sort's first ``width`` columns ("" nowhere)."""
    generator = torch.Generator().manual_seed(0)
    for probs in _cases(generator):
        want_values, want_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        vocab = probs.shape[1]
        for width in sorted({1, 2, 7, 32, 48, vocab - 1, vocab} & set(range(1, vocab + 1))):
            values, ids = kernel(probs, width)
            same = torch.equal(ids, want_ids[:, :width]) and torch.equal(
                values.nan_to_num(-1.0), want_values[:, :width].nan_to_num(-1.0)
            )
            if not same:
                return f"its selection differs from the full sort's at {tuple(probs.shape)}, width {width}"
    return ""


@functools.cache
def compiled() -> tuple[Callable | None, str]:
    """``select(probs, width)`` for core/sampling.py (None off a CPU or off float32), or None and why not."""
    module, why = cpu_kernels.checked(lambda module: check(module.top_candidates))
    if module is None:
        return None, why
    kernel = module.top_candidates

    def select(probs: torch.Tensor, width: int):
        if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 2:
            return None
        return kernel(probs, width)

    return select, ""


def selection() -> Callable | None:
    """The checked kernel's ``select`` where it runs, else None (the sampler's torch.topk); says why once."""
    select, why = compiled()
    if select is None:
        log.info("sampling: torch.topk selects the top-k candidates (the CPU kernel is not used: %s)", why)
    return select
