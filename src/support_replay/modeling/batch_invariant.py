"""A batch-invariant forward for Hugging Face decoder models (true-on-policy mode).

The logits of a sequence must not depend on what else is in the batch, on padding, or on
how the sequence was split between prefill and decode steps, so that the engine (KV cache,
left-padded batches) and the trainer (one right-padded forward) compute the same bits.
Measured on this project's CPU (docs/true-on-policy.md): a row of ``F.linear`` is the same
bits whatever the other rows hold and wherever it sits, once the row count is a multiple of
16 (1, 2 or ragged row counts take other kernels); row reductions (RMSNorm) and
elementwise ops (RoPE, SiLU, residuals) are per row already. Attention is the one place
where shapes differ between the two sides; here every query row attends with a product of
exactly its own key prefix, ``[heads, 1, d] x [heads, d, n]``, the same shapes on both sides.

``make_batch_invariant(model)`` switches a loaded model to this forward in place.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "support_replay_batch_invariant"
ROW_BLOCK = 16


def _padded_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    extra = -rows.shape[0] % ROW_BLOCK
    if extra:
        rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
    out = F.linear(rows, self.weight, self.bias)
    return out[: out.shape[0] - extra].reshape(*x.shape[:-1], out.shape[-1])


def batch_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention row by row over each query's own allowed keys; returns ``[B, q, H, d]``."""
    batch, heads, q_len, dim = query.shape
    repeat = heads // key.shape[1]
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scale = dim**-0.5 if scaling is None else scaling
    k_len = key.shape[2]
    if attention_mask is None:  # plain causal, no padding
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None].expand(batch, -1, -1)
    else:
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask == 0
    rows = []
    for b in range(batch):
        out_b = []
        for i in range(q_len):
            keys = allowed[b, i].nonzero().squeeze(1)
            if len(keys) == 0:  # a padding query: nothing to attend, nothing reads it
                out_b.append(query.new_zeros(heads, dim))
                continue
            scores = torch.matmul(query[b, :, i : i + 1], key[b, :, keys].transpose(-1, -2)) * scale
            probs = torch.softmax(scores, dim=-1)
            out_b.append(torch.matmul(probs, value[b, :, keys])[:, 0])
        rows.append(torch.stack(out_b))
    return torch.stack(rows), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def full_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False  # always a boolean mask: padding must be seen
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, batch_invariant_attention)
    AttentionMaskInterface.register(ATTENTION, full_mask)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Batch-invariant linears and attention for ``model`` (a Hugging Face causal LM), in place."""
    _register()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_padded_linear, module)
    model.set_attn_implementation(ATTENTION)
    return model
