"""The probe that picks a batch-invariant linear product per weight shape on this CPU
(modeling/invariant_products.py), on kernels made to misbehave the way other CPUs' do, and the
refusals and fallbacks that follow from its answer."""

import pytest
import torch
import torch.nn.functional as F

from support_replay.errors import ConfigError
from support_replay.modeling import invariant_products
from support_replay.modeling.invariant_products import InvariantPlan, invariant_linear, padded, probe_plan, tiled

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels

BUMP = 1 + 2.0**-20  # changes a float32's last bits, as another reduction order would


def exact(x, w, b=None):
    """A product whose bits no kernel can change: integer-valued inputs, so every partial sum is exact
    (the misbehaving kernels below are built on it, not on this CPU's F.linear, whose own row and
    column behaviour differs between CPUs and ISA limits)."""
    return F.linear(x.round(), w.round(), b)


def invariant_at_multiples_of_32(x, w, b=None):
    return exact(x, w, b) * (1.0 if x.shape[0] % 32 == 0 else BUMP)


def depends_on_the_row_count(x, w, b=None):
    # the bits change with the row count whatever the padding: only fixed-shape tiles make it invariant
    return exact(x, w, b) * BUMP ** ((x.shape[0] // 16) % 3)


def reads_the_other_rows(x, w, b=None):
    return exact(x, w, b) + x.sum() * 1e-3


def depends_on_the_column_count(x, w, b=None):
    return exact(x, w, b) * (1.0 if w.shape[0] % 64 == 0 else BUMP)


def test_a_kernel_invariant_at_a_larger_multiple_is_padded_to_it():
    plan = probe_plan(invariant_at_multiples_of_32, 48, 40, torch.float32, pads=(16, 32, 64))
    assert plan == InvariantPlan(32, tiled=False, columns=True)


def test_a_kernel_that_reads_the_row_count_is_run_in_fixed_tiles():
    plan = probe_plan(depends_on_the_row_count, 48, 40, torch.float32, pads=(16, 32, 64))
    assert plan == InvariantPlan(16, tiled=True, columns=True)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 40, generator=gen), torch.randn(300, 40, generator=gen)
    product = tiled(depends_on_the_row_count, 16)
    whole = product(x, w)
    assert torch.equal(whole, exact(x, w) * BUMP)  # every call is one full tile
    for count, at in ((1, 0), (17, 5), (100, 200)):
        assert torch.equal(product(x[at : at + count], w), whole[at : at + count])
    assert not torch.equal(padded(depends_on_the_row_count, 16)(x[:20], w), whole[:20])


def test_a_kernel_without_an_invariant_plan_gets_none():
    assert probe_plan(reads_the_other_rows, 48, 40, torch.float32) is None


def test_column_subsets_are_probed_for_the_union_head():
    plan = probe_plan(depends_on_the_column_count, 128, 40, torch.float32, pads=(16,))
    assert plan == InvariantPlan(16, tiled=False, columns=False)


def test_true_on_policy_is_refused_by_name_where_no_shape_has_a_plan(tiny_checkpoint, monkeypatch):
    from support_replay.engine import Engine

    monkeypatch.setattr(invariant_products, "invariant_plan", lambda kernel, out, inp, dtype, threads: None)
    with pytest.raises(
        ConfigError,
        match=r"--true-on-policy-mode: no batch-invariant product for a \d+x\d+ torch.float32 linear layer "
        r"on the '(torch|onednn)' kernel at \d threads on this CPU \(.+\)",
    ):
        Engine.from_pretrained(tiny_checkpoint, deterministic=True)
    Engine.from_pretrained(tiny_checkpoint)  # the normal engine needs no invariant product


def test_the_plan_is_applied_per_weight_shape(monkeypatch):
    plans = {(48, 40): InvariantPlan(32, False, True), (24, 40): InvariantPlan(16, True, True)}
    monkeypatch.setattr(
        invariant_products, "invariant_plan", lambda kernel, out, inp, dtype, threads: plans[(out, inp)]
    )
    calls = []
    monkeypatch.setattr(
        invariant_products, "padded", lambda linear, rows: calls.append(("pad", rows)) or padded(linear, rows)
    )
    monkeypatch.setattr(
        invariant_products, "tiled", lambda linear, rows: calls.append(("tiles", rows)) or tiled(linear, rows)
    )
    invariant_linear.cache_clear()  # the product per kernel, and its product per shape, are cached
    product = invariant_linear("torch")
    x = torch.randn(5, 40)
    torch.testing.assert_close(product(x, torch.ones(48, 40)), F.linear(x, torch.ones(48, 40)))
    product(x, torch.ones(24, 40))
    product(x, torch.ones(24, 40))
    assert calls == [("pad", 32), ("tiles", 16)]  # once per shape
    invariant_linear.cache_clear()


def test_the_trainer_scores_through_the_full_head_where_column_subsets_change_bits(tiny_checkpoint, monkeypatch):
    """A CPU whose head product takes other bits over a subset of its columns: the true-on-policy
    actor leaves the union head for the full head (the engine's own product), and stays exact."""
    from support_replay.train import actor as actor_module

    real = invariant_products.invariant_plan
    monkeypatch.setattr(
        invariant_products,
        "invariant_plan",
        lambda *key: None if (p := real(*key)) is None else InvariantPlan(p.rows, p.tiled, columns=False),
    )
    ctx = type("Ctx", (), {"device": "cpu", "world": 1})()
    common = dict(
        lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, replay=True, full_with_grad=False, linear_kernel="torch"
    )
    assert not actor_module.Actor(tiny_checkpoint, ctx, batch_invariant=True, **common).sparse_head
    assert actor_module.Actor(tiny_checkpoint, ctx, batch_invariant=False, **common).sparse_head
