"""The compiled elementwise work of a decode layer (modeling/decode_layer.py): the models' own bits, what it refuses,
and what happens where it cannot run. The fused step's bits with it: tests/engine/test_fused_step.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from support_replay.engine import Engine
from support_replay.modeling import decode_layer

pytestmark = pytest.mark.float_bits  # compares this CPU's kernels; CI reruns it on AVX2 kernels


@pytest.fixture(scope="module")
def kernels():
    built, why = decode_layer.compiled()
    if built is None:
        pytest.skip(f"the compiled layer kernels cannot run here: {why}")
    return built


@pytest.fixture(params=["loops", "aten"])
def arithmetic(request, kernels):
    """The mean and SiLU in the kernels' own loops, then through ATen's calls; the process's choice restored."""
    before = kernels.use_aten_calls(request.param == "aten")
    yield request.param
    kernels.use_aten_calls(before)


# the arithmetic fixture sets the mode once for every example, which is what they need
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 40),
    hidden=st.integers(1, 300).map(lambda n: 2 * n),
    eps=st.sampled_from([1e-5, 1e-6, 0.1]),
    scale=st.sampled_from([1e-3, 1.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_the_norms_adds_and_silu_are_the_models_bits(kernels, arithmetic, rows, hidden, eps, scale, seed):
    g = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    x, update = torch.randn(rows, 1, hidden, generator=g) * scale, torch.randn(rows, 1, hidden, generator=g)
    gate_up = torch.randn(rows, 1, 2 * hidden, generator=g) * 6
    with torch.inference_mode():
        assert torch.equal(kernels.rms_norm(x, norm.weight, eps), norm(x))
        total, normed = kernels.add_rms_norm(x, update, norm.weight, eps)
        assert torch.equal(total, x + update) and torch.equal(normed, norm(x + update))
        gate, up = gate_up.split(hidden, dim=-1)
        assert torch.equal(kernels.silu_mul(gate_up, hidden), F.silu(gate) * up)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 20),
    kv_heads=st.integers(1, 4),
    group=st.integers(1, 4),
    dim=st.sampled_from([8, 32, 64, 80, 128]),
    norms=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_queries_keys_and_values_are_the_models_bits_in_their_slots(
    kernels, rows, kv_heads, group, dim, norms, seed
):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = torch.randn(rows, 1, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 500
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    head_norm = Qwen3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        head_norm.weight.copy_(torch.randn(dim, generator=g))
    slots = torch.randperm(3 * rows, generator=g)[:rows]
    caches = torch.full((2, kv_heads, 3 * rows, dim), 7.0)
    with torch.inference_mode():
        q, k, v = (t.view(rows, 1, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        if norms:
            q, k = head_norm(q), head_norm(k)
        want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        weight = head_norm.weight if norms else None
        got = kernels.attention_inputs(qkv, heads, kv_heads, dim, cos, sin, weight, weight, 1e-6, *caches, slots)
    assert got.shape == (rows, heads, 1, dim) and torch.equal(got, want_q)
    assert torch.equal(caches[0][:, slots], want_k[:, :, 0].transpose(0, 1))
    assert torch.equal(caches[1][:, slots], v[:, 0].transpose(0, 1))
    untouched = torch.ones(3 * rows, dtype=torch.bool)
    untouched[slots] = False
    assert bool((caches[:, :, untouched] == 7.0).all())  # no other slot written


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 5),
    width=st.one_of(st.integers(1, 300), st.integers(300, 70000)),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_the_loops_round_as_atens_mean_and_silu(kernels, arithmetic, rows, width, scale, seed):
    # the cascade of ATen's sum has levels every 16, 256 and 4096 groups of four vectors: the long rows reach them
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * scale
    gate_up = torch.randn(rows, 1, 2 * min(width, 3000), generator=g) * 6
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    with torch.inference_mode():
        assert torch.equal(kernels.mean_of_squares(x), x.pow(2).mean(-1, keepdim=True))
        assert torch.equal(kernels.silu_mul(gate_up, gate.shape[-1]), F.silu(gate) * up)


def test_the_loops_give_way_to_atens_calls_where_they_differ(kernels):
    class LoopsOneUlpOff:  # the loops' mean is one ulp off; ATen's calls are right
        aten = True

        def __getattr__(self, name):
            return getattr(kernels, name)

        def use_aten_calls(self, on):
            before, self.aten = self.aten, on
            kernels.use_aten_calls(on)
            return before

        def mean_of_squares(self, x):
            mean = kernels.mean_of_squares(x)
            return mean if self.aten else torch.nextafter(mean, torch.tensor(float("inf")))

    before = kernels.use_aten_calls(False)
    try:
        fake = LoopsOneUlpOff()
        assert decode_layer._choose_arithmetic(fake) == "" and fake.aten
        assert decode_layer._choose_arithmetic(kernels) == "" and not kernels.use_aten_calls(False)
    finally:
        kernels.use_aten_calls(before)


def test_a_kernel_that_changes_the_bits_is_not_used(kernels):
    assert decode_layer.check(kernels) == ""

    class OneUlpOff:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def rms_norm(self, x, weight, eps):
            return torch.nextafter(kernels.rms_norm(x, weight, eps), torch.tensor(float("inf")))

    assert decode_layer.check(OneUlpOff()).startswith("its RMSNorm differs from LlamaRMSNorm's at ")


def test_bad_inputs_are_refused_by_name(kernels):
    caches = torch.zeros(2, 1, 4, 8)
    qkv, cos = torch.randn(2, 1, 24), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="row 1's slot 4 is outside the cache's 4"):
        kernels.attention_inputs(qkv, 1, 1, 8, cos, cos, None, None, 0.0, *caches, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match=r"qkv \[2, 1, 24\] for 2 \+ 2 x 1 heads of 8"):
        kernels.attention_inputs(qkv, 2, 1, 8, cos, cos, None, None, 0.0, *caches, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor, got BFloat16"):
        kernels.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight of \[6\] for rows of 8"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(6), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up of .* for 5 \\+ 5 columns"):
        kernels.silu_mul(torch.ones(2, 1, 8), 5)


def test_models_the_kernels_do_not_compute_keep_pytorchs_operations(tiny_checkpoint, kernels):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    assert decode_layer.unsupported(model) is None
    norm = model.model.layers[1].post_attention_layernorm
    norm.forward = lambda x: x
    assert decode_layer.unsupported(model) == "a norm is Qwen3RMSNorm, not Qwen3RMSNorm as the kernels compute it"
    del norm.forward
    model.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3
    assert decode_layer.unsupported(model) == "the query and key norms' epsilons differ"
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).eval()
    assert decode_layer.unsupported(bf16) == "the model is not float32 on a CPU"


def test_the_engine_decodes_with_them_and_without_a_build(tiny_checkpoint, kernels, unbuildable_kernels):
    engine = Engine.from_pretrained(tiny_checkpoint)
    assert engine.runner.fused is not None and engine.runner.fused.layer_kernels is kernels
    with unbuildable_kernels():
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
        assert decode_layer.unsupported(model).startswith("it did not build in ")
        from support_replay.engine.fused_step import FusedDecoder

        assert FusedDecoder(model).layer_kernels is None
