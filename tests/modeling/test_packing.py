"""Packed group scoring: a prompt's samples scored as one row (the prompt once, each response
attending to the prompt and to itself) give the unpacked scores and gradients."""

import numpy as np
import pytest
import torch

from recipe_helpers import run_config
from support_replay.core.support import SupportTable
from support_replay.errors import ConfigError
from support_replay.modeling.packed_sequences import packed_layout
from support_replay.rollout.sample import Sample
from support_replay.train import train
from support_replay.train.actor import load_scoring_model
from support_replay.train.batches import build_micro_batch, plan_optimizer_steps
from support_replay.train.scorer import Outputs, Scorer

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def group_samples(seed=0, vocab=384):
    """Two prompts x 3 samples of different lengths, a support per token, one multi-turn loss mask."""
    rng = np.random.default_rng(seed)
    samples = []
    for g, plen in enumerate((9, 14)):
        prompt = rng.integers(5, vocab, plen).tolist()
        for j, rlen in enumerate((7, 3, 11)[:3]):
            response = rng.integers(5, vocab, rlen).tolist()
            rows = [np.unique(np.append(rng.integers(0, vocab, 6), t)).astype(np.int32) for t in response]
            mask = np.ones(rlen, np.int8)
            if j == 2:
                mask[4:8] = 0  # a tool's output inside the response: scored, not trained
            samples.append(
                Sample(
                    index=len(samples),
                    group=g,
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=mask,
                    log_mu=np.zeros(rlen, np.float32),
                    support=SupportTable.from_rows(rows),
                )
            )
    return samples


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-head", "dense-head"])
def test_packed_scores_and_gradients_equal_unpacked(tiny_checkpoint, sparse):
    samples = group_samples()
    order = [3, 0, 4, 1, 5, 2]  # groups interleaved: packing regroups them
    model = load_scoring_model(tiny_checkpoint, "cpu")
    results = {}
    for pack in (False, True):
        batch = build_micro_batch(samples, order, True, "cpu", pack=pack)
        if pack:
            assert batch.input_ids.shape == (2, 14 + 21) and sorted(batch.indices) == sorted(order)
        model.zero_grad()
        sc = Scorer(model, 0.9, replay=True, sparse=sparse, outputs=Outputs(full=not sparse, entropy=not sparse))(batch)
        per_sample = dict(zip(batch.indices, batch.split(sc.logp)))
        weights = torch.cat([torch.from_numpy(samples[i].loss_mask).float() * (i + 1) for i in batch.indices])
        (sc.logp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        extra = None if sparse else dict(zip(batch.indices, zip(batch.split(sc.full), batch.split(sc.entropy))))
        results[pack] = (per_sample, grads, extra)
    (flat, flat_grads, flat_extra), (packed, packed_grads, packed_extra) = results[False], results[True]
    for i in order:
        assert torch.allclose(flat[i], packed[i], atol=2e-5), i
        if not sparse:
            assert torch.allclose(flat_extra[i][0], packed_extra[i][0], atol=2e-5) and torch.allclose(
                flat_extra[i][1], packed_extra[i][1], atol=2e-5
            )
    assert flat_grads.keys() == packed_grads.keys()
    for name, g in flat_grads.items():
        assert float((g - packed_grads[name]).abs().max()) <= 1e-5 * float(g.abs().max()), (
            name
        )  # float rounding of sums of ~1e3


def test_the_planner_keeps_a_prompts_samples_together():
    samples = group_samples()
    samples = samples[:3] + samples[3:]
    steps = plan_optimizer_steps(
        samples, global_batch=6, micro_batch=3, rank=0, world=1, replay=True, device="cpu", pack=True
    )
    parts = [mb.indices for mb in steps[0].micro_batches]
    assert sorted(map(sorted, parts)) == [[0, 1, 2], [3, 4, 5]]  # one packed row each
    assert all(mb.input_ids.shape[0] == 1 for mb in steps[0].micro_batches)
    budget = plan_optimizer_steps(
        samples, global_batch=6, micro_batch=3, rank=0, world=1, replay=True, device="cpu", pack=True, max_tokens=2 * 35
    )
    assert [mb.input_ids.shape[0] for mb in budget[0].micro_batches] == [
        2
    ]  # two packed rows of at most 35 fit 70 tokens


def test_a_packed_run_trains_as_an_unpacked_one(tiny_checkpoint, tmp_path):
    packed = train(run_config(tiny_checkpoint, tmp_path / "p", num_rollout=2, packed_scoring="on"))
    flat = train(run_config(tiny_checkpoint, tmp_path / "f", num_rollout=2, packed_scoring="off"))
    for a, b in zip(packed, flat):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["train_rollout_logprob_abs_diff_max"] < 1e-3  # --ci-test on both


def test_packing_with_what_needs_rows_of_their_own_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError,
        match="--packed-scoring='on': penalties and logit bias are replayed over each sequence's own history",
    ):
        run_config(tiny_checkpoint, tmp_path, packed_scoring="on", rollout_repetition_penalty=1.2)
    assert run_config(
        tiny_checkpoint, tmp_path, true_on_policy_mode=True
    ).pack_groups  # the batch-invariant attention unpacks per sequence
    assert not run_config(
        tiny_checkpoint, tmp_path, rollout_repetition_penalty=1.2
    ).pack_groups  # auto: rows of their own
    assert run_config(tiny_checkpoint, tmp_path).pack_groups


def long_group_samples(vocab=384):
    """One prompt of 40 tokens x responses of 10, 30 and 90: sequences of 50 to 130 positions, so the
    packed row's later responses sit past block edges they do not cross alone (64-key blocks)."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(5, vocab, 40).tolist()
    samples = []
    for rlen in (10, 30, 90):
        response = rng.integers(5, vocab, rlen).tolist()
        rows = [np.unique(np.append(rng.integers(0, vocab, 5), t)).astype(np.int32) for t in response]
        samples.append(
            Sample(
                index=len(samples),
                group=0,
                prompt_ids=prompt,
                response_ids=response,
                loss_mask=np.ones(rlen, np.int8),
                log_mu=np.zeros(rlen, np.float32),
                support=SupportTable.from_rows(rows),
            )
        )
    short = rng.integers(5, vocab, 6).tolist()  # a second row: padding in the packed batch
    samples.append(
        Sample(
            index=3,
            group=1,
            prompt_ids=short,
            response_ids=[7, 8],
            loss_mask=np.ones(2, np.int8),
            log_mu=np.zeros(2, np.float32),
            support=SupportTable.from_rows([np.array([7, 9], np.int32), np.array([8], np.int32)]),
        )
    )
    return samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-head", "dense-head"])
def test_packed_batch_invariant_scores_are_the_unpacked_bits(tiny_checkpoint, threads, sparse, dtype):
    samples = long_group_samples()
    order = [2, 3, 0, 1]
    model = load_scoring_model(tiny_checkpoint, "cpu", batch_invariant=True, compute_dtype=dtype)
    scores, grads = {}, {}
    for pack in (False, True):
        batch = build_micro_batch(samples, order, True, "cpu", pack=pack)
        model.zero_grad()
        sc = Scorer(model, 0.9, replay=True, sparse=sparse, outputs=Outputs(full=not sparse, entropy=not sparse))(batch)
        scores[pack] = {i: s for i, s in zip(batch.indices, batch.split(sc.logp))}
        weights = torch.cat([torch.full((samples[i].response_length,), 0.5 + i) for i in batch.indices])
        (sc.logp * weights).sum().backward()
        grads[pack] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the engine's bits are the unpacked forward's (tests/modeling/test_batch_invariant.py): now the packed one's too
    for i in order:
        assert torch.equal(scores[True][i], scores[False][i]), (
            i,
            (scores[True][i] - scores[False][i]).abs().max().item(),
        )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 gradients: PyTorch's products, rounded to bf16
    for name, g in grads[False].items():  # the same math; sums in another order
        assert float((g - grads[True][name]).abs().max()) <= tolerance * float(g.abs().max()), (
            name,
            float((g - grads[True][name]).abs().max()),
            float(g.abs().max()),
        )


def test_the_packed_layout_puts_each_sequence_at_its_positions():
    segments = torch.tensor([[-1, -1, -1, 0, 0, 1, 1, 1, 2, -2], [-1, -1, 0, -2, -2, -2, -2, -2, -2, -2]])
    layout = packed_layout(segments, align=64)
    assert layout.key_flat[:, :5].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [0, 1, 2, 8, 0], [10, 11, 12, 0, 0]]
    assert layout.query_flat[:, :5].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [10, 11, 12, 0, 0]]
    assert layout.query_valid.sum(1).tolist() == [5, 3, 1, 3]
    assert layout.allowed[1, 0, :5].tolist() == [True, True, True, True, False]  # response 1's first token: position 3
    assert layout.allowed[1, 2, :7].tolist() == [True] * 6 + [False]
    assert layout.key_flat.shape[1] == 64  # keys padded to whole blocks of align
    assert packed_layout(segments).key_flat.shape[1] == 6  # sdpa's: the longest sequence


def test_packed_sdpa_attends_per_sequence_with_the_unpacked_math(tiny_checkpoint, monkeypatch):
    from support_replay.modeling import packed_sequences
    from support_replay.modeling.packed_sequences import PACKED_SDPA

    monkeypatch.setattr(packed_sequences, "PER_SEQUENCE_GAIN", 0.0)  # per sequence whatever it saves
    samples = long_group_samples()
    order = [2, 3, 0, 1]
    model = load_scoring_model(tiny_checkpoint, "cpu")
    assert model.hf.config._attn_implementation == PACKED_SDPA  # sdpa, a packed row taken apart per sequence
    results = {}
    for pack in (False, True):
        batch = build_micro_batch(samples, order, True, "cpu", pack=pack)
        model.zero_grad()
        sc = Scorer(model, 0.9, replay=True, sparse=False, outputs=Outputs(full=True, entropy=True))(batch)
        weights = torch.cat([torch.full((samples[i].response_length,), 0.5 + i) for i in batch.indices])
        (sc.logp * weights + sc.entropy).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[pack] = (dict(zip(batch.indices, batch.split(sc.logp))), grads)
    (flat, flat_grads), (packed, packed_grads) = results[False], results[True]
    for i in order:
        assert torch.allclose(flat[i], packed[i], atol=2e-5), i
    for name, g in flat_grads.items():  # finite: the padding's empty query slots never reach a gradient
        assert torch.isfinite(packed_grads[name]).all() and float((g - packed_grads[name]).abs().max()) <= 1e-5 * float(
            g.abs().max()
        ), name


def test_sdpa_goes_per_sequence_where_it_saves_scores():
    def layout(response: int):
        prompt, group = 44, 4
        marks = [-1] * prompt + [j for j in range(group) for _ in range(response)]
        return packed_layout(torch.tensor([marks]), align=1)

    assert layout(32).saving < 2.0 < layout(128).saving  # measured: per sequence pays from about 128-token responses
    assert abs(layout(512).saving - (44 + 4 * 512) ** 2 / (4 * 556 * 556)) < 1e-9  # the 3.5x of the docs
