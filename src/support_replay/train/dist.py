"""Process group setup: torchrun ranks, or a one-rank group for a plain process (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistContext:
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    owns = False
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:  # a plain process: a group of one, so FSDP2 and the collectives work unchanged
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        owns = True
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistContext(rank, dist.get_world_size(), device, owns)


def close_distributed(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.barrier()  # without it a rank sometimes aborts at exit
        dist.destroy_process_group()


def broadcast_object(obj, ctx: DistContext):
    """rank 0's ``obj`` on every rank."""
    if ctx.world == 1:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RankFailure(RuntimeError):
    """Rank 0 failed in work only it does; every other rank stops with this, naming rank 0's error."""


def on_main(fn, ctx: DistContext):
    """``fn()`` on rank 0, its result on every rank. If it raises, rank 0 re-raises it and every other
    rank raises ``RankFailure`` with its message, so no rank is left waiting in a collective that rank 0
    will never reach (a reward function that raised left them in a broadcast while rank 0 sat in a barrier)."""
    if ctx.world == 1:
        return fn()
    result, failure, error = None, None, None
    if ctx.is_main:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised below, after the others heard of it)
            error, failure = exc, f"{type(exc).__name__}: {exc}"
    status, value = broadcast_object(("failed", failure) if failure else ("ok", result), ctx)
    if status == "failed":
        if ctx.is_main:
            raise error
        raise RankFailure(f"rank {ctx.rank}: rank 0 failed, stopping with it: {value}")
    return value


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    if ctx.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def gather_by_index(local: dict, n: int, ctx: DistContext) -> list:
    """Per-sample values (tensors, or tuples of tensors) held by different ranks, as one list
    in sample order on every rank."""
    if ctx.world > 1:

        def cpu(v):
            return tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()

        parts = [None] * ctx.world
        dist.all_gather_object(parts, {i: cpu(v) for i, v in local.items()})
        local = {i: v for part in parts for i, v in part.items()}
    missing = [i for i in range(n) if i not in local]
    if missing:
        raise RuntimeError(f"gather_by_index: samples {missing[:5]} were scored by no rank")
    return [local[i] for i in range(n)]
