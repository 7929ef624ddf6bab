"""oneDNN products over packed weights keep the plain product's bits (modeling/packed_weights.py),
and the engine's fused decode step keeps its packs in step with the weights (engine/fused_step.py)."""

import pytest
import torch

from support_replay.engine import Engine
from support_replay.modeling.invariant_products import cpu_name, invariant_linear
from support_replay.modeling.linear_kernels import linear_function, onednn_available
from support_replay.modeling.packed_weights import pack_weight, packed_linear, packed_rows_from
from tiny_model import greedy_decode

pytestmark = [
    pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN linear op"),
    pytest.mark.float_bits,
]


def rows_from_or_skip(shape, dtype, plain, threads):
    """The probe's answer; where it refuses packing the engine keeps plain weights (tested below)."""
    rows_from = packed_rows_from(*shape, dtype, plain, threads)
    if rows_from is None:
        pytest.skip(f"packed {shape} {dtype} products do not keep the plain product's bits on this CPU ({cpu_name()})")
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
    rows_from = rows_from_or_skip(shape, torch.float32, plain, threads)  # 2 where one row takes another kernel
    assert packed_rows_from(*shape, torch.float32, invariant_linear("onednn"), threads) in (
        1,
        2,
        None,
    )  # the batch-invariant product's
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
    rows_from_or_skip((49152, 576), torch.float32, linear_function("onednn"), threads)
    assert torch.equal(packed_linear(x, pack_weight(w)), linear_function("onednn")(x, w))


def decode_logits(engine: Engine, prompts, steps: int) -> list[torch.Tensor]:
    return greedy_decode(engine.runner, prompts, steps)


@pytest.mark.parametrize("deterministic", [False, True], ids=["normal", "batch-invariant"])
def test_the_fused_step_decodes_over_packs_with_the_plain_weights_bits(tiny_checkpoint, deterministic):
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=deterministic, linear_kernel="onednn")
    fused = engine.runner.fused
    for prompts in (
        [[5, 6, 7, 8], [9, 10], [20 + i for i in range(30)]],
        [[5, 6, 7]],
    ):  # three rows packed, one row plain
        packed = decode_logits(engine, prompts, 3)
        head_packs = (
            packed_rows_from(*fused.head.weight.shape, torch.float32, fused.linear, torch.get_num_threads()) is not None
        )
        assert (
            all(fused.layers[0].packs[name] for name in ("qkv", "o", "gate_up", "down"))
            and (fused._head_pack is not None) == head_packs
        )
        fused.packing = False
        plain = decode_logits(engine, prompts, 3)
        assert not fused.layers[0].packs  # switched off: the packs are dropped
        fused.packing = True
        assert all(torch.equal(a, b) for a, b in zip(packed, plain))


def test_packs_follow_weights_written_in_place_and_the_thread_count(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, linear_kernel="onednn")
    model, fused = engine.runner.model, engine.runner.fused
    rows_from_or_skip(
        tuple(model.model.layers[1].mlp.down_proj.weight.shape), torch.float32, fused.linear, torch.get_num_threads()
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    before = decode_logits(engine, prompts, 2)
    old_pack = fused.layers[1].packs["down"]
    with torch.no_grad():  # a user's in-place write, not the engine's update path: the version counter sees it
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    after = decode_logits(engine, prompts, 2)
    assert fused.layers[1].packs["down"].weight is not old_pack.weight and fused.layers[0].packs["down"] is not None
    fused.packing = False
    assert all(torch.equal(a, b) for a, b in zip(after, decode_logits(engine, prompts, 2)))
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
    engine = Engine.from_pretrained(tiny_checkpoint, linear_kernel="onednn")
    fused, prompts = engine.runner.fused, [[5, 6, 7, 8], [9, 10, 11]]
    rows_from_or_skip(tuple(fused.layers[0].qkv.shape), torch.float32, fused.linear, torch.get_num_threads())
    first = decode_logits(engine, prompts, 2)
    engine.release_packed_weights()
    assert not fused.layers[0].packs and fused._head_pack is None
    again = decode_logits(engine, prompts, 2)
    assert fused.layers[0].packs["qkv"] is not None and all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_synchronous_trainer_releases_the_engines_packs_before_it_updates(asynchronous):
    from types import SimpleNamespace

    from support_replay.train.dist import DistContext
    from support_replay.train.producer import RolloutProducer

    calls = []

    class Rollouts:
        def produce(self, r):
            return [], {}

        def release_engine_memory(self):
            calls.append("release")

    production = SimpleNamespace(async_rollout=asynchronous, stale_sample_policy="fail")
    producer = RolloutProducer(
        Rollouts(), production, 2, DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)
    )
    producer.start(0)
    producer.take(0, ["v0"])
    producer.close()
    assert calls == (
        [] if asynchronous else ["release"]
    )  # async: the next rollout is being generated beside the update
