"""The batch-invariant forward of true-on-policy mode for Hugging Face decoder models.

A token's logits must not depend on what else is in the batch, on padding, on packing, or on how its sequence was
split between prefill and decode steps, so that the engine (a KV cache, left-padded prefills, decode steps of a few
rows) and the trainer (right-padded or packed rows of thousands of tokens) compute the same bits. Every operation on
the path from the embeddings to the logits that reduces or transforms a row runs this project's invariant arithmetic
(kernels/invariant.py): each linear layer, the RMSNorms, SiLU x up, the rotary angles, the attention and a
mixture-of-experts router's softmax. What remains is elementwise and exactly rounded in any order (the residual adds,
the rotary products, the experts' weighting) or exact (embedding lookups, top-k). So the equality holds by
construction, on every CPU and under every ATen kernel set; nothing is probed.

``make_batch_invariant(model, dtype)`` switches a loaded model to this forward in place. ``dtype`` is the compute
dtype (float32 or bfloat16): weights, activations and every rounded result take it, as a model loaded in that dtype
computes, so a trainer holding float32 master weights computes in bf16 what an engine holding bf16 weights computes
(the weights rounded to bf16 alike). Families covered: Llama, Qwen2/3, Mistral and the sparse blocks of Qwen2-MoE,
Qwen3-MoE, OLMoE and Mixtral (modeling/moe.py); another layer kind is refused by name.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..kernels import invariant
from .linear_kernels import use_linear

ATTENTION = "support_replay_batch_invariant"
# the norm, MLP and rotary classes whose forward this module repeats (read from transformers 5: weight * (x *
# rsqrt(mean(x^2) + eps)).to(dtype); down(act(gate(x)) * up(x)); cos and sin of position x inv_freq, halves repeated)
FAMILIES = ("Llama", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Mistral", "Mixtral", "Olmoe")
NORMS = {f"{family}RMSNorm" for family in FAMILIES}
MLPS = {f"{family}MLP" for family in FAMILIES}
ROTARIES = {f"{family}RotaryEmbedding" for family in FAMILIES}
SHARED_EXPERT_BLOCKS = {"Qwen2MoeSparseMoeBlock"}  # a sigmoid-gated shared expert beside the routed ones
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # set once at init; 'dynamic' and 'longrope' change per call
DTYPES = (torch.float32, torch.bfloat16)


def batch_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: ``[B, Lq, H, d]`` from ``[B, H, Lq, d]`` queries over ``[B, G, L, d]`` keys
    and values (kernels/invariant.attention: each query over the keys its mask row sees, in key order). A packed
    row's mask says which keys each of its queries sees; ``packed_segments`` adds nothing to it."""
    if dropout:
        raise ConfigError(f"true-on-policy mode: attention dropout {dropout} (it draws noise the engine does not)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return invariant.attention(query, key, value, attention_mask, scale), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def full_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False  # always a boolean mask: padding must be seen
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, batch_invariant_attention)
    AttentionMaskInterface.register(ATTENTION, full_mask)


def _linear_in(dtype: torch.dtype):
    def product(x, weight, bias=None):
        return invariant.linear(x.to(dtype), weight, bias)

    product.kernel = "invariant"
    return product


def _norm_forward(self, hidden_states):
    return invariant.rms_norm(hidden_states.to(self._support_replay_dtype), self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(invariant.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _rotary_forward(self, x, position_ids):
    cos, sin = invariant.rotary(self.inv_freq, position_ids, self.attention_scaling)
    return cos.to(x.dtype), sin.to(x.dtype)


def _shared_expert_block_forward(self, hidden_states):
    """Qwen2-MoE's sparse block (transformers 5: routed experts plus a shared expert scaled by sigmoid of its gate)
    with that sigmoid as the invariant softmax of ``[0, z]``: ATen's vectorised sigmoid rounds a token by its place
    in the tensor (lanes or the scalar tail), so the batch would change its bits."""
    batch, length, hidden = hidden_states.shape
    flat = hidden_states.view(-1, hidden)
    shared = self.shared_expert(flat)
    _, weights, chosen = self.gate(flat)
    routed = self.experts(flat, chosen, weights)
    z = self.shared_expert_gate(flat).float()
    scale = invariant.softmax(torch.cat([torch.zeros_like(z), z], -1))[:, 1:]
    return (routed + scale.to(shared.dtype) * shared).reshape(batch, length, hidden)


def _embedding_forward(self, input_ids):
    return F.embedding(input_ids, self.weight.to(self._support_replay_dtype), self.padding_idx)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot run batch-invariant (None when it can)."""
    act = getattr(model.config, "hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r} (the invariant forward computes SiLU)"
    if (getattr(model.config, "pretraining_tp", 1) or 1) != 1:
        return f"pretraining_tp {model.config.pretraining_tp}"
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and kind not in NORMS or kind.endswith("LayerNorm"):
            return f"{name} is a {kind}, which the invariant forward does not compute"
        if kind.endswith("MLP") and kind not in MLPS:
            return f"{name} is a {kind}, which the invariant forward does not compute"
        if kind.endswith("RotaryEmbedding"):
            if kind not in ROTARIES:
                return f"{name} is a {kind}, which the invariant forward does not compute"
            if module.rope_type not in STATIC_ROPE:
                return f"rope type {module.rope_type!r} (its angles change per call; known: {list(STATIC_ROPE)})"
    return None


def make_batch_invariant(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` (a Hugging Face causal LM on a CPU) computes its forward with the invariant arithmetic in ``dtype``
    (default: its weights' dtype), in place; parameters, hooks and the module tree stay as they were."""
    from .moe import install_routing

    dtype = dtype or next(model.parameters()).dtype
    if dtype not in DTYPES:
        raise ConfigError(f"true-on-policy mode computes in float32 or bfloat16, not {dtype}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError("true-on-policy mode: the invariant kernels run on a CPU; the model is not on one")
    why = unsupported(model) or invariant.available()
    if why is not None:
        raise ConfigError(f"true-on-policy mode: {why}")
    _register()
    use_linear(model, _linear_in(dtype))
    model.__dict__["_support_replay_invariant"] = dtype
    for module in model.modules():
        kind = type(module).__name__
        module.__dict__["_support_replay_dtype"] = dtype
        if kind in NORMS:
            module.forward = types.MethodType(_norm_forward, module)
        elif kind in MLPS:
            module.forward = types.MethodType(_mlp_forward, module)
        elif kind in ROTARIES:
            module.forward = types.MethodType(_rotary_forward, module)
        elif kind in SHARED_EXPERT_BLOCKS:
            module.forward = types.MethodType(_shared_expert_block_forward, module)
        elif isinstance(module, nn.Embedding) and module.weight.dtype != dtype:
            module.forward = types.MethodType(_embedding_forward, module)
    install_routing(model)  # the sparse blocks read the model's operations at every call (modeling/moe.py)
    model.set_attn_implementation(ATTENTION)
    return model


def invariant_dtype(model: nn.Module) -> torch.dtype | None:
    """The compute dtype ``make_batch_invariant`` gave ``model``, or None where it runs its own forward."""
    return model.__dict__.get("_support_replay_invariant")


def act_mul(model: nn.Module, act=F.silu):
    """``f(gate, up) = act(gate) * up`` as ``model`` computes it: the invariant kernel (SiLU), or PyTorch's
    operations with the module's ``act``."""
    if invariant_dtype(model) is not None:
        return invariant.silu_mul
    return lambda gate, up: act(gate) * up


def router_softmax(model: nn.Module):
    """``f(logits) = softmax(logits)`` in float32 as ``model``'s routers compute it."""
    if invariant_dtype(model) is not None:
        return invariant.softmax
    return lambda logits: F.softmax(logits, dtype=torch.float, dim=-1)
