"""Our sparse-block forward: transformers' eager experts bit for bit, recording, replay (slime's R3
semantics: captured experts, current router weights, a gradient for the router), batch invariance."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay.errors import ConfigError
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.modeling.moe import install_routing, routing_shape

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(params=["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def moe_path(request):
    fixture = {"qwen3_moe": "tiny_moe_checkpoint"}.get(request.param, f"tiny_{request.param}_checkpoint")
    return request.getfixturevalue(fixture)


def test_our_forward_is_transformers_eager_experts_bit_for_bit(moe_path):
    stock = load(moe_path)
    stock.set_experts_implementation("eager")
    ours = copy.deepcopy(stock)
    control = install_routing(ours)
    assert install_routing(ours) is control  # once per model
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, ours(ids).logits)


def test_the_routing_shape_and_a_dense_model(moe_path, tiny_checkpoint):
    shape = routing_shape(load(moe_path))
    assert (shape.layers, shape.top_k, shape.num_experts, shape.moe_layers) == (2, 2, 8, (0, 1))
    assert routing_shape(load(tiny_checkpoint)) is None and install_routing(load(tiny_checkpoint)) is None


def test_recorded_choices_are_the_routers_top_k(moe_path):
    model = load(moe_path)
    control = install_routing(model)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    control.record_next()
    with torch.no_grad():
        model(ids)
    routed = control.stacked()
    hook.remove()
    assert routed.shape == (18, 2, 2) and routed.dtype == torch.int32
    assert torch.equal(routed[:, 1], seen[0].int())


def test_replay_uses_the_captured_experts_with_the_current_routers_weights(moe_path):
    model = load(moe_path)
    control = install_routing(model)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    control.record_next()
    with torch.no_grad():
        plain = model(ids).logits
    own = control.stacked().long()
    with torch.no_grad(), control.replaying(own):  # replaying its own choices: the same bits
        assert torch.equal(model(ids).logits, plain)
    assert control.take_agreement() == (36, 36)
    other = own.clone()
    other[:, 0] = torch.tensor([6, 7])  # every position of layer 0 to experts 6 and 7
    other[5] = -1  # a free position routes itself
    captured = []
    gate = model.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda m, a, out: captured.append(out))
    with control.replaying(other):
        logits = model(ids).logits
    hook.remove()
    logits_, weights, index = captured[0]
    probs = torch.softmax(logits_.float(), -1)
    expected = probs.gather(-1, index)
    if getattr(model.config, "norm_topk_prob", True):  # Qwen2-MoE and OLMoE as configured here keep the raw top-k
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(index[0], torch.tensor([6, 7])) and torch.equal(index[5], own[5, 0])
    assert torch.allclose(weights, expected)
    same, compared = control.take_agreement()
    assert compared == 34 and same < compared
    logits.sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0  # the router still learns


def test_replay_of_the_wrong_token_count_is_refused(tiny_moe_checkpoint):
    model = load(tiny_moe_checkpoint)
    control = install_routing(model)
    with pytest.raises(ConfigError, match="layer 0 routes 10 tokens, the replayed routing has 4 rows"):
        with torch.no_grad(), control.replaying(torch.zeros(4, 2, 2, dtype=torch.long)):
            model(torch.zeros(1, 10, dtype=torch.long))


def test_the_batch_invariant_forward_routes_a_row_alike_in_any_batch(moe_path):
    model = load(moe_path)
    control = install_routing(model)
    make_batch_invariant(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (5, 13), generator=gen)
    with torch.no_grad():
        alone = model(ids[2:3]).logits
        batched = model(ids).logits
    assert torch.equal(alone[0], batched[2])
    assert control is not None


def test_an_unknown_mixture_of_experts_family_is_refused_by_name(tiny_checkpoint):
    model = load(tiny_checkpoint)

    class ForeignSparseMoeBlock(torch.nn.Module):
        def forward(self, x):
            return x

    model.model.layers[0].mlp = ForeignSparseMoeBlock()
    with pytest.raises(ConfigError, match="layer 0 has a ForeignSparseMoeBlock module"):
        install_routing(model)
