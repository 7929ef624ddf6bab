"""Mixture-of-experts layers of Hugging Face decoders, with their routing recorded or replayed.

transformers 5 builds the sparse block of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral the same way:
a top-k router (``gate``) that returns ``(logits, top-k weights, top-k ids)`` and a bank of experts
(``experts``, 3-D ``gate_up_proj`` / ``down_proj``) that adds each token's chosen experts, weighted,
in expert-id order. ``install_routing`` gives those two modules a forward of ours, the same
operations in the same order, with two differences:

- every product runs through the model's linear (``model_linear``), and the router's softmax, its top-k sum and
  the experts' SiLU x up through the model's own (modeling/batch_invariant.py): the oneDNN kernel where the
  run uses it, and in true-on-policy mode the invariant arithmetic, so a token's expert output
  has the same bits in the engine's decode step as in the trainer's packed forward;
- the router can record its choices (the engine's capture) or replay given ones (the trainer's
  routing replay, R3).

Replay follows slime's R3 (``slime/utils/routing_replay.py``: ``probs = scores.gather(1,
top_indices)``, read from THUDM/slime): the experts are the captured ones, their combine weights
the current router's probabilities at those experts (renormalised where the model normalises its
top-k), so the router still gets a gradient. A position whose captured row is ``FREE`` (-1) routes
itself. While replaying, the router's own top-k is compared with the captured one
(``routing_agreement``, measured before replay replaces it).
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..core.routing import RoutingShape
from ..errors import ConfigError
from .batch_invariant import act_mul, invariant_dtype, router_softmax
from .linear_kernels import model_linear

# router class -> whether it casts its top-k weights back to the logits' dtype (Mixtral's stay float32)
ROUTERS = {
    "Qwen3MoeTopKRouter": True,
    "Qwen2MoeTopKRouter": True,
    "OlmoeTopKRouter": True,
    "MixtralTopKRouter": False,
}
EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts", "OlmoeExperts", "MixtralExperts")
_MOE_WORDS = ("Router", "Experts", "SparseMoe", "MoeBlock")


def _decoder_layers(model: nn.Module):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return list(getattr(decoder, "layers", []))


def _named(modules, names):
    return next((m for m in modules if type(m).__name__ in names), None)


def moe_blocks(model: nn.Module) -> list[tuple[int, nn.Module, nn.Module]]:
    """``(layer index, router, experts)`` of every sparse block (the module holding a known router and its
    experts), in layer order; a MoE module of a family this project has not read is refused by name
    rather than routed some other way."""
    blocks = []
    for i, layer in enumerate(_decoder_layers(model)):
        for module in layer.modules():
            router = _named(module.children(), ROUTERS)
            if router is not None:
                experts = _named(module.children(), EXPERTS)
                if experts is None:
                    raise ConfigError(f"model: the {type(router).__name__} router has no experts beside it")
                blocks.append((i, router, experts))
                continue
            name = type(module).__name__
            if any(w in name for w in _MOE_WORDS) and name not in ROUTERS and name not in EXPERTS:
                raise ConfigError(
                    f"model: layer {i} has a {name} module; mixture-of-experts support covers "
                    f"{sorted(ROUTERS)} (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral)"
                )
    return blocks


def _shape_of(model: nn.Module, blocks) -> RoutingShape | None:
    if not blocks:
        return None
    router = blocks[0][1]
    return RoutingShape(
        layers=len(_decoder_layers(model)),
        top_k=int(router.top_k),
        num_experts=int(router.num_experts),
        moe_layers=tuple(i for i, _, _ in blocks),
    )


def routing_shape(model: nn.Module) -> RoutingShape | None:
    """The model's routing shape, or None for a dense model."""
    return _shape_of(model, moe_blocks(model))


def moe_weights(model: nn.Module) -> list[torch.Tensor]:
    """One weight of every product shape of the sparse blocks (router, each expert's two projections)."""
    return [
        w
        for _, router, experts in moe_blocks(model)
        for w in (router.weight, experts.gate_up_proj[0], experts.down_proj[0])
    ]


class RoutingControl:
    """The switch of a model's routers: route freely, record the choices, or replay given ones."""

    def __init__(self, model: nn.Module, shape: RoutingShape):
        self.model = model  # its linear is read at every call: use_linear may come after installation
        self.shape = shape
        self.recorded: dict[int, torch.Tensor] | None = None  # layer -> [N, top_k] ids of the last forward
        self.replay: torch.Tensor | None = None  # [N, layers, top_k] captured ids, FREE (-1) routes itself
        self.agreement = [0, 0]  # (equal top-k sets, compared) over the replayed forwards since the last reset

    def linear(self):
        return model_linear(self.model)

    def act_mul(self, act):
        return act_mul(self.model, act)

    def softmax(self):
        return router_softmax(self.model)

    def top_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values.sum(-1, keepdim=True)``; in true-on-policy mode added left to right (an order of this code's)."""
        if invariant_dtype(self.model) is None:
            return values.sum(dim=-1, keepdim=True)
        total = values[:, :1]
        for j in range(1, values.shape[1]):
            total = total + values[:, j : j + 1]
        return total

    def record_next(self) -> None:
        """The routers keep their choices until ``stacked`` reads them (the engine's capture)."""
        self.recorded = {}

    def stacked(self) -> torch.Tensor:
        """The recorded choices, ``[N, layers, top_k]`` int32 (layers without experts hold 0)."""
        rec = self.recorded or {}
        n = next(iter(rec.values())).shape[0] if rec else 0
        out = torch.zeros(n, self.shape.layers, self.shape.top_k, dtype=torch.int32)
        for layer, ids in rec.items():
            out[:, layer] = ids.to("cpu", torch.int32)
        self.recorded = None
        return out

    @contextmanager
    def replaying(self, routing: torch.Tensor | None):
        """Within: the routers use ``routing`` (``[N, layers, top_k]``, rows of the forward's
        flattened tokens; FREE rows route themselves); None routes freely."""
        self.replay = routing
        try:
            yield self
        finally:
            self.replay = None

    def choose(self, layer: int, own: torch.Tensor) -> torch.Tensor | None:
        """The replayed ids for this layer's ``own`` choices, or None to keep them (recording them if asked)."""
        if self.recorded is not None:
            self.recorded[layer] = own.detach()
        if self.replay is None:
            return None
        captured = self.replay[:, layer].to(own.device, own.dtype)
        if captured.shape != own.shape:
            raise ConfigError(
                f"routing replay: layer {layer} routes {own.shape[0]} tokens, the replayed routing has "
                f"{captured.shape[0]} rows of top-{captured.shape[1]}"
            )
        free = (captured < 0).any(-1, keepdim=True)
        with torch.no_grad():
            live = ~free[:, 0]
            same = (own.sort(-1).values == captured.sort(-1).values).all(-1) & live
            self.agreement[0] += int(same.sum())
            self.agreement[1] += int(live.sum())
        return torch.where(free, own, captured)

    def take_agreement(self) -> tuple[int, int]:
        out, self.agreement = tuple(self.agreement), [0, 0]
        return out


def _router_forward(self, hidden_states):
    control: RoutingControl = self._support_replay_routing
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = control.linear()(hidden_states, self.weight)  # (tokens, experts)
    router_probs = control.softmax()(router_logits)
    top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    replayed = control.choose(self._support_replay_layer, top_index)
    if replayed is not None:  # the captured experts, weighted by the current router (slime's R3)
        top_index = replayed
        top_value = router_probs.gather(-1, top_index)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always normalises
        top_value = top_value / control.top_sum(top_value)
    if ROUTERS[type(self).__name__]:
        top_value = top_value.to(router_logits.dtype)
    return router_logits, top_value, top_index


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' loop over the experts hit, each product through the model's linear."""
    control = self._support_replay_routing
    linear, act_mul = control.linear(), control.act_mul(self.act_fn)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in expert_hit:
        expert = expert[0]
        if expert == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        gate, up = linear(hidden_states[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
        out = linear(act_mul(gate, up), self.down_proj[expert])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def install_routing(model: nn.Module) -> RoutingControl | None:
    """Our forward for every sparse block of ``model`` (in place, parameters unchanged); returns its
    routing switch, the same one on a second call, or None for a dense model."""
    existing = model.__dict__.get("_support_replay_routing")
    if existing is not None:
        return existing
    blocks = moe_blocks(model)
    shape = _shape_of(model, blocks)
    if shape is None:
        return None
    control = RoutingControl(model, shape)
    for layer, router, experts in blocks:
        for module in (router, experts):
            module.__dict__["_support_replay_routing"] = control
        router.__dict__["_support_replay_layer"] = layer
        router.forward = types.MethodType(_router_forward, router)
        experts.forward = types.MethodType(_experts_forward, experts)
    model.__dict__["_support_replay_routing"] = control
    return control


def routing_control(model: nn.Module) -> RoutingControl | None:
    """The switch ``install_routing`` gave ``model``, if any."""
    return model.__dict__.get("_support_replay_routing")
