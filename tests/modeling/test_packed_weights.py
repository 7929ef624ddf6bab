"""oneDNN products over packed weights keep the plain product's bits (modeling/packed_weights.py),
and the engine's fused decode step keeps its packs in step with the weights (engine/fused_step.py).

Whether a packed product keeps the plain product's bits is this CPU's oneDNN's answer, probed per shape
(``packed_rows_from``): the engine packs where it says yes, and keeps plain weights where it says no. The tests check
both answers' promise on whatever CPU runs them (other data where the probe said yes; no pack where it said no);
none is skipped for the CPU's answer."""

import pytest
import torch

from support_replay.engine import Engine, EngineSettings
from support_replay.modeling import packed_weights
from support_replay.modeling.linear_kernels import linear_function, onednn_available
from support_replay.modeling.packed_weights import pack, pack_weight, packed_linear, packed_rows_from
from tiny_model import greedy_decode

pytestmark = [
    pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN linear op"),
    pytest.mark.float_bits,
]


def probed(weight: torch.Tensor, plain) -> int | None:
    """The probe's answer for ``weight``'s shape; where it is no, ``pack`` keeps the weight plain (asserted here)."""
    rows_from = packed_rows_from(*weight.shape, weight.dtype, plain, torch.get_num_threads())
    if rows_from is None:
        assert pack(weight, plain) is None
    return rows_from


SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


@pytest.mark.parametrize("shape", SMOLLM2_SHAPES + [(200, 96)])
def test_packed_rows_are_the_plain_products_bits(threads, shape):
    # other data than the probe's, every row count the probe skips up to 33, and rows at offsets
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(*shape, generator=gen)
    many = torch.randn(600, shape[1], generator=gen)
    packed = pack_weight(w)
    plain = linear_function("onednn")
    rows_from = probed(w, plain)  # 2 where one row takes another kernel
    if rows_from is None:  # never packed here: nothing to compare
        return
    for count in list(range(rows_from, 34)) + [63, 128, 257, 600]:
        for at in {0, 3, 600 - count}:
            rows = many[at : at + count]
            assert torch.equal(packed_linear(rows, packed), plain(rows, w)), (count, at)
    assert torch.equal(
        packed_linear(many[None, :16], packed), plain(many[:16], w)[None]
    )  # leading dims, as the decode step's [B, 1, in]


def test_the_head_shape_packs_with_the_same_bits(threads):
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(49152, 576, generator=gen)  # SmolLM2's tied head
    x = torch.randn(40, 576, generator=gen)
    if probed(w, linear_function("onednn")) is None:  # the head stays plain here
        return
    assert torch.equal(packed_linear(x, pack_weight(w)), linear_function("onednn")(x, w))


def decode_logits(engine: Engine, prompts, steps: int) -> list[torch.Tensor]:
    return greedy_decode(engine.runner, prompts, steps)


def test_the_fused_step_decodes_over_packs_with_the_plain_weights_bits(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(linear_kernel="onednn"))
    fused = engine.runner.fused
    for prompts in (
        [[5, 6, 7, 8], [9, 10], [20 + i for i in range(30)]],
        [[5, 6, 7]],
    ):  # three rows packed, one row plain
        packed = decode_logits(engine, prompts, 3)
        for name, weight in fused.layers[0].weights().items():  # packed exactly where the probe says it keeps bits
            used = fused.fused_products or name in ("o", "down")  # a product the step runs over this weight
            expected = used and probed(weight, fused.linear) is not None
            assert (fused.layers[0].packs.get(name) is not None) == expected, name
        assert (fused._head_pack is not None) == (probed(fused.head.weight, fused.linear) is not None)
        fused.packing = False
        plain = decode_logits(engine, prompts, 3)
        assert not fused.layers[0].packs  # switched off: the packs are dropped
        fused.packing = True
        assert all(torch.equal(a, b) for a, b in zip(packed, plain))


def test_packs_follow_weights_written_in_place_and_the_thread_count(tiny_checkpoint, monkeypatch):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(linear_kernel="onednn"))
    model, fused = engine.runner.model, engine.runner.fused
    keeps_bits = probed(model.model.layers[1].mlp.down_proj.weight, fused.linear) is not None
    # the bookkeeping is tested on every CPU: where this CPU's packed products change bits, packs are made anyway
    monkeypatch.setattr(packed_weights, "packed_rows_from", lambda *args: 2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    before = decode_logits(engine, prompts, 2)
    old_pack = fused.layers[1].packs["down"]
    with torch.no_grad():  # a user's in-place write, not the engine's update path: the version counter sees it
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    after = decode_logits(engine, prompts, 2)
    assert fused.layers[1].packs["down"].weight is not old_pack.weight and fused.layers[0].packs["down"] is not None
    fused.packing = False
    plain = decode_logits(engine, prompts, 2)
    for a, b in zip(after, plain):  # the repacked weights: the plain weights' bits where this CPU's packs keep them
        assert torch.equal(a, b) if keeps_bits else torch.allclose(a, b, atol=1e-5, rtol=0)
    assert not torch.equal(after[0], before[0])
    fused.packing = True
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if saved != 1 else 2)
        decode_logits(engine, prompts, 1)
        assert fused._packed_threads == torch.get_num_threads()  # checked and packed again at the new count
    finally:
        torch.set_num_threads(saved)


def test_bf16_decodes_over_packs_with_f_linears_bits(tiny_checkpoint, threads):
    engine = Engine.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    fused = engine.runner.fused
    assert engine.linear_kernel == "torch" and fused.can_pack
    head = fused.head.weight
    packs = (
        packed_rows_from(*head.shape, torch.bfloat16, fused.linear, threads) is not None
    )  # the probe decides, per CPU
    for prompts in ([[5, 6, 7, 8], [9, 10], [20 + i for i in range(30)]], [[5, 6, 7]]):
        packed = decode_logits(engine, prompts, 3)
        assert (
            fused._head_pack is not None
        ) == packs  # where the probe refuses, plain weights: the same bits trivially
        fused.packing = False
        plain = decode_logits(engine, prompts, 3)
        fused.packing = True
        assert all(torch.equal(a, b) for a, b in zip(packed, plain))


def test_released_packs_are_made_again_by_the_next_step(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(linear_kernel="onednn"))
    fused, prompts = engine.runner.fused, [[5, 6, 7, 8], [9, 10, 11]]
    made = fused.fused_products and probed(fused.layers[0].qkv, fused.linear) is not None
    first = decode_logits(engine, prompts, 2)
    engine.release_packed_weights()
    assert not fused.layers[0].packs and fused._head_pack is None
    again = decode_logits(engine, prompts, 2)
    assert (fused.layers[0].packs.get("qkv") is not None) == made and all(
        torch.equal(a, b) for a, b in zip(first, again)
    )


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_synchronous_trainer_releases_the_engines_packs_before_it_updates(asynchronous):
    from support_replay.train.dist import DistContext
    from support_replay.train.producer import RolloutProducer
    from support_replay.train.sections import ProductionConfig

    calls = []

    class Rollouts:
        def produce(self, r, pushed=None):
            return [], {}

        def release_engine_memory(self):
            calls.append("release")

    production = ProductionConfig(async_rollout=asynchronous, max_policy_lag=int(asynchronous))
    producer = RolloutProducer(
        Rollouts(), production, 2, DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)
    )
    producer.start(0)
    producer.take(0, ["v0"])
    producer.close()
    assert calls == (
        [] if asynchronous else ["release"]
    )  # async: the next rollout is being generated beside the update
