"""How the trainer's ranks split the work: data x context x tensor parallel, on one DeviceMesh.

``world = dp x cp x tp`` with tensor parallelism innermost (the ranks that exchange the most
sit next to each other). Ranks of one data-parallel group (same ``dp_rank``) run the same
micro-batches: their TP ranks split the heads, MLP and vocabulary, their CP ranks the sequence.
FSDP2 shards the parameters over ``dp x cp`` (the CP ranks hold the same parameters and
compute gradients for different tokens, so their gradients are reduced like data
parallelism's); TP splits them further.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    cp_layout: str = "zigzag"
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    mesh: object = None  # DeviceMesh ("dp", "cp", "tp"), None for one process

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks that run the same micro-batch (its CP and TP ranks)."""
        return self.cp * self.tp

    def group(self, dim: str):
        return self.mesh[dim].get_group() if self.mesh is not None else None

    @property
    def fsdp_mesh(self):
        """The ranks FSDP2 shards over: dp x cp."""
        if self.cp == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "cp"]._flatten("dp_cp")

    def gradient_scale(self) -> int:
        """FSDP averages gradients over the ``dp x cp`` ranks; the losses are normalised by global
        counts and split over CP ranks by token, so their sum is wanted: scale by ``dp x cp``."""
        return self.dp * self.cp


def parallel_layout(ctx, *, tp: int = 1, cp: int = 1, cp_layout: str = "zigzag") -> ParallelLayout:
    if ctx.world % (tp * cp):
        raise ConfigError(
            f"--tensor-model-parallel-size={tp} x --context-parallel-size={cp}: must divide the {ctx.world} ranks "
            "(the rest is data parallelism)"
        )
    dp = ctx.world // (tp * cp)
    if ctx.world == 1:
        return ParallelLayout(cp_layout=cp_layout)
    # DTensor warns at every step that a norm over (dp, tp) reduces in two collectives: known, and small
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh(ctx.device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    dp_rank, cp_rank, tp_rank = mesh.get_coordinate()
    assert dist.get_rank() == (dp_rank * cp + cp_rank) * tp + tp_rank
    return ParallelLayout(dp, cp, tp, cp_layout, dp_rank, cp_rank, tp_rank, mesh)
