"""Context parallelism for Hugging Face decoders: each CP rank runs the positions of its chunks.

A sequence of padded length ``L`` is split by position (``parallel.context_parallel_positions``:
contiguous chunks, or zigzag for causal load balance). Every rank embeds and transforms its own
positions with their true position ids; attention is the one place that needs the others:
each layer all-gathers the keys and values of the whole sequence over the CP group (an
autograd all-gather whose backward sums the key/value gradients of every rank's queries) and
attends its queries to the keys at or before their position that are not padding.
torch's own context-parallel attention targets CUDA kernels; this one runs anywhere.

The response rows a rank scores are those whose logit position it holds; ``assemble_rows``
puts every rank's rows into one vector on every rank (a sum in which each row comes from one
rank, so the values are exact) and passes the gradient of a loss replicated on the CP ranks
straight back to the rank that computed each row, so the gradients are the single-device
ones (an all-gather's summing backward would make them cp times too large).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

ATTENTION = "support_replay_context_parallel"


@dataclass
class ContextShard:
    """What a rank's attention needs to know of the whole sequence."""

    group: object  # the CP process group
    query_positions: torch.Tensor  # [L_local] positions this rank holds
    key_order: torch.Tensor  # [L] indices putting the gathered keys in position order
    key_valid: torch.Tensor  # [B, L] bool, the key at that position is not padding


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), local.shape[2]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries read this rank's keys
        return grad[:, :, ctx.rank * ctx.size : (ctx.rank + 1) * ctx.size], None


class _AssembleRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group):
        out = rows.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # the loss is replicated: each rank keeps the gradient of its own rows


def replicated_sum(values: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of each rank's share (zeros where it has none), for a loss every rank of
    the group computes alike: the backward hands each rank the gradient of its own share."""
    return _AssembleRows.apply(values, group)


def assemble_rows(values: torch.Tensor, mine: torch.Tensor, group) -> torch.Tensor:
    """``[n_mine, ...]`` values of this rank's rows -> ``[N, ...]`` on every CP rank, exact, gradient passed through."""
    full = values.new_zeros((mine.shape[0], *values.shape[1:])).index_put((mine.nonzero().squeeze(1),), values)
    return replicated_sum(full, group)


def context_parallel_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    context_shard: ContextShard | None = None,
    **kwargs,
):
    """Attention of this rank's queries over the whole sequence's keys; returns ``[B, q, H, d]``."""
    shard = context_shard
    if shard is None:
        raise RuntimeError("context-parallel attention called without its ContextShard")
    keys = _GatherSequence.apply(key, shard.group)[:, :, shard.key_order]
    values = _GatherSequence.apply(value, shard.group)[:, :, shard.key_order]
    repeat = query.shape[1] // keys.shape[1]
    if repeat > 1:
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    positions = torch.arange(keys.shape[2], device=query.device)
    allowed = (positions[None, :] <= shard.query_positions[:, None])[None] & shard.key_valid[:, None, :]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[:, None], scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def make_context_parallel(hf: nn.Module, cp: int) -> None:
    """Switch ``hf`` to the context-parallel attention (in place)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    layer_types = getattr(hf.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(
            f"--context-parallel-size={cp}: the model has {sorted(set(layer_types) - {'full_attention'})} layers; "
            "only full attention is split here"
        )
    AttentionInterface.register(ATTENTION, context_parallel_attention)
    AttentionMaskInterface.register(
        ATTENTION, lambda *args, **kwargs: None
    )  # the attention builds its own from ContextShard
    hf.set_attn_implementation(ATTENTION)
