"""The learning-rate schedule in optimizer steps, as Megatron (slime's and Miles' trainer) counts them, from
torch's schedulers: a linear warmup to ``--lr``, then constant, linear or cosine decay to ``--min-lr``,
reached at ``--lr-decay-iters``, then ``--min-lr`` (docs/training.md, "learning-rate schedules").

Optimizer step ``s`` (0-based) is Megatron's iteration ``n = s + 1``: during the warmup it runs at
``lr * n / W``; then the decay ratio is ``(n - W) / (D - W)`` (cosine ``min + (lr - min)(1 + cos(pi r))/2``,
linear ``lr + (min - lr) r``), and ``min_lr`` from ``n = D`` on.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

FOREVER = 2**62  # a ConstantLR that never ends


def warmup_steps(total_steps: int, warmup_iters: int, warmup_fraction: float | None) -> int:
    """Warmup steps: ``--lr-warmup-iters``, or ``--lr-warmup-fraction`` of the run's optimizer steps."""
    if warmup_fraction is not None:
        return int(math.floor(warmup_fraction * total_steps))
    return warmup_iters


def lr_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, warmup: int, decay_style: str, decay_end: int,
                 min_lr: float):  # fmt: skip
    """A scheduler to step after every optimizer step; the optimizer's lr is then the next step's."""
    parts, milestones = [], []
    if warmup >= 2:
        parts.append(LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1))
        milestones.append(warmup - 1)  # the warmup's last step, at lr, is the decay's ratio 0
    start = max(warmup - 1, 0)
    length = decay_end - warmup  # steps from ratio 0 (excluded) to ratio 1
    if decay_style == "constant":
        parts.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
    else:
        if decay_style == "cosine":
            parts.append(CosineAnnealingLR(optimizer, T_max=length, eta_min=min_lr))
        else:
            parts.append(LinearLR(optimizer, start_factor=1.0, end_factor=min_lr / lr, total_iters=length))
        milestones.append(start + length)
        parts.append(ConstantLR(optimizer, factor=min_lr / lr, total_iters=FOREVER))  # past the decay: min_lr
    scheduler = parts[0] if len(parts) == 1 else SequentialLR(optimizer, parts, milestones=milestones)
    if warmup == 0 and decay_style != "constant":  # no warmup: the first step is already iteration 1 of the decay
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step() before optimizer.step()": on purpose
            scheduler.step()
    return scheduler


def scheduled_lr(step: int, *, lr: float, warmup: int, decay_style: str, decay_end: int, min_lr: float) -> float:
    """Megatron's learning rate at optimizer step ``step`` (0-based), the closed form ``lr_scheduler`` follows."""
    n = step + 1
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if decay_style == "constant":
        return lr
    if n >= decay_end:
        return min_lr
    ratio = (n - warmup) / (decay_end - warmup)
    if decay_style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))
    return lr + (min_lr - lr) * ratio
