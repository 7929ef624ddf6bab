"""The deterministic forward: a sequence's logits are the same bits in the engine (left-padded
batches, KV cache, prefill then decode) and in the trainer (one right-padded forward)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.engine import Engine
from support_replay.engine.model_runner import ModelRunner
from support_replay.modeling.batch_invariant import (
    KEY_BLOCK,
    ROW_BLOCK,
    batch_invariant_attention,
    make_batch_invariant,
    tall_products_keep_tile_bits,
)
from support_replay.modeling.invariant_decode import SOFTMAX_ROUND, softmax_trims, tile_rows
from support_replay.protocol import GenerateRequest
from tiny_model import assert_answers_as_alone

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def _reference_attention(q, k, v, allowed):
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (9, 3, 64)], ids=["tiny", "smollm2-heads"])
def test_block_attention_decode_equals_full_forward_for_key_lengths_63_to_129(threads, heads, kv_heads, dim):
    """One query over a left-padded cache (random padding, a neighbour row of noise) gets the
    same bits as the same query in a right-padded causal forward, for every key count from 63 to
    129 (across the 64-key block edges); the forward is attention (sdpa to 1e-6) and its
    gradient is attention's. The decode tile is smaller than the trainer's (``tile_rows``) and its
    scores cover the seen columns only (``trimmed_width``)."""
    gen = torch.Generator().manual_seed(threads)
    length = 130
    q = torch.randn(2, heads, length, dim, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, length, dim, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, length, dim, generator=gen, requires_grad=True)
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
    allowed[1, :, 100:] = False  # row 1 right-padded after 100 tokens
    allowed[1, 100:] = False
    full, _ = batch_invariant_attention(None, q, k, v, allowed[:, None], scaling=dim**-0.5)
    expected = _reference_attention(q, k, v, allowed)
    assert torch.allclose(full[0], expected[0], atol=1e-5) and torch.allclose(
        full[1, :100], expected[1, :100], atol=1e-5
    )
    assert not full[1, 100:].any()  # padding queries: zeros, never NaN
    grads = torch.autograd.grad(full[0].sum() + full[1, :100].sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected[0].sum() + expected[1, :100].sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4)
    with torch.no_grad():
        for n in range(63, 130):  # the query at position n - 1 sees n keys
            pad = int(torch.randint(0, 70, (1,), generator=gen))
            width = pad + n + int(torch.randint(0, 3, (1,), generator=gen))  # a cache column or two past it: masked
            cache_k = torch.randn(2, kv_heads, width, dim, generator=gen)
            cache_v = torch.randn(2, kv_heads, width, dim, generator=gen)
            cache_k[0, :, pad : pad + n], cache_v[0, :, pad : pad + n] = k[0, :, :n], v[0, :, :n]
            seen = torch.zeros(2, 1, 1, width, dtype=torch.bool)
            seen[0, 0, 0, pad : pad + n] = True
            seen[1] = True
            query = torch.stack([q[0, :, n - 1 : n], torch.randn(heads, 1, dim, generator=gen)])
            out, _ = batch_invariant_attention(None, query, cache_k, cache_v, seen, scaling=dim**-0.5)
            assert torch.equal(out[0, 0], full[0, n - 1]), n


@pytest.mark.parametrize("repeat", [1, 3, 5, 9, 13])
def test_a_decode_tile_keeps_the_bits_of_a_full_tile(threads, repeat):
    """The probe's row count covers the query heads and is a full tile or gives every row the
    full tile's bits, checked here on other data, more tiles per call and widths between the
    probed ones."""
    dim = 64
    rows = tile_rows(repeat, dim, torch.float32, torch.get_num_threads())
    assert rows >= repeat and rows % 4 == 0 and rows <= ROW_BLOCK
    gen = torch.Generator().manual_seed(100 + repeat)
    q = torch.randn(7, ROW_BLOCK, dim, generator=gen)
    for width in (64, 320, 704):
        keys = torch.randn(7, dim, width, generator=gen)
        assert torch.equal(torch.bmm(q[:, :rows].contiguous(), keys), torch.bmm(q, keys)[:, :rows]), width
    probs, values = torch.rand(7, ROW_BLOCK, KEY_BLOCK, generator=gen), torch.randn(7, KEY_BLOCK, dim, generator=gen)
    assert torch.equal(torch.bmm(probs[:, :rows].contiguous(), values), torch.bmm(probs, values)[:, :rows])


def test_a_trimmed_softmax_row_keeps_the_bits_of_whole_blocks(threads):
    """Where the probe allows trimming, a softmax row over its seen columns rounded up to 16 is
    the same bits as over whole key blocks with the rest masked, on other data than the probe's."""
    if not softmax_trims(torch.float32, torch.get_num_threads()):
        pytest.skip("this CPU's softmax depends on trailing masked columns: decode steps do not trim")
    gen = torch.Generator().manual_seed(7)
    for n in (1, 5, 15, 16, 17, 47, 64, 65, 100, 129, 250):
        trimmed = max(SOFTMAX_ROUND, -(-n // SOFTMAX_ROUND) * SOFTMAX_ROUND)
        scores = torch.full((24, 3 * KEY_BLOCK + KEY_BLOCK * (n // KEY_BLOCK)), float("-inf"))
        scores[:, :n] = torch.randn(24, n, generator=gen) * 6
        assert torch.equal(torch.softmax(scores[:, :trimmed], -1), torch.softmax(scores, -1)[:, :trimmed]), n


def test_a_tall_product_keeps_every_tiles_bits(threads):
    """Where the probe allows one product per key/value head in the trainer, every row is the bits
    of its own 16-row tile's product, on other data, tile counts and widths than the probe's."""
    if not tall_products_keep_tile_bits(64, torch.float32, torch.get_num_threads()):
        pytest.skip("this CPU's tall products differ from 16-row tiles: the trainer keeps the tiles")
    gen = torch.Generator().manual_seed(11)
    for tiles, width in ((5, 128), (13, 320), (40, 704)):
        q = torch.randn(2, tiles * ROW_BLOCK, 64, generator=gen)
        keys = torch.randn(2, width, 64, generator=gen).transpose(1, 2)
        per_tile = torch.bmm(q.reshape(2 * tiles, ROW_BLOCK, 64), keys.repeat_interleave(tiles, 0)).reshape(
            2, -1, width
        )
        assert torch.equal(torch.bmm(q, keys), per_tile), (tiles, width)


def test_engine_and_trainer_logits_are_bitwise_equal(tiny_checkpoint, threads):
    model = make_batch_invariant(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval())
    runner = ModelRunner(model)
    # decode steps cross the 64- and 128-key block edges; prompts of different lengths pad the cache
    prompts = [[5 + i % 50 for i in range(61)], [11, 12], [20 + i % 30 for i in range(125)]]
    batch, logits = runner.prefill(prompts)
    steps, seqs = [logits], [list(p) for p in prompts]
    nxt, pos = logits.argmax(-1), torch.tensor([len(p) for p in prompts])
    for _ in range(6):
        for s, x in zip(seqs, nxt.tolist()):
            s.append(x)
        logits = runner.decode(batch, nxt, pos)
        pos += 1
        steps.append(logits)
        nxt = logits.argmax(-1)
    order = [2, 0, 1]  # another batch, another order, right padding
    width = max(len(s) for s in seqs)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for r, k in enumerate(order):
        ids[r, : len(seqs[k])] = torch.tensor(seqs[k])
        mask[r, : len(seqs[k])] = 1
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.float()
    for t, step in enumerate(steps):
        for k in range(3):
            assert torch.equal(full[order.index(k), len(prompts[k]) - 1 + t], step[k]), (t, k)


def test_deterministic_engine_output_does_not_depend_on_the_batch(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=True).start()
    try:
        req = GenerateRequest(
            [5, 6, 7], SamplingParams(top_k=20, top_p=0.9, seed=3), max_new_tokens=8, return_sampling_mask=True
        )
        alone = engine.generate([req])[0]
        others = [
            GenerateRequest([9, 9, 9, 9, 9, 9][: 2 + i], SamplingParams(top_k=10, seed=i), max_new_tokens=5 + i)
            for i in range(3)
        ]
        crowded = engine.generate(others[:2] + [req] + others[2:])[2]
        assert (
            alone.output_ids == crowded.output_ids
            and np.array_equal(alone.log_mu, crowded.log_mu)
            and alone.support == crowded.support
        )
        model = engine.runner.model
        with torch.no_grad():
            logits = model(torch.tensor([req.input_ids + alone.output_ids])).logits[0, 2:-1].float()
        again = support_logprobs(logits, torch.tensor(alone.output_ids), alone.support, 1.0)
        assert torch.equal(again, torch.from_numpy(alone.log_mu))  # bit for bit
    finally:
        engine.shutdown()


def test_a_grpo_group_is_prefilled_once_and_answers_as_if_alone(tiny_checkpoint, monkeypatch):
    """4 prompts x 4 samples: one prefill row per distinct prompt; with the deterministic forward
    every request's tokens, supports and log mu equal the same request sent alone."""
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=True)
    rows = []
    original = engine.runner._prefill
    monkeypatch.setattr(
        engine.runner, "_prefill", lambda prompts, hits: rows.append(len(prompts)) or original(prompts, hits)
    )
    engine.start()
    try:
        prompts = [[5, 6, 7], [11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34]]
        reqs = [
            GenerateRequest(
                p, SamplingParams(top_k=20, top_p=0.9, seed=10 * g + j), max_new_tokens=6, return_sampling_mask=True
            )
            for g, p in enumerate(prompts)
            for j in range(4)
        ]
        together = engine.generate(reqs)
        assert rows == [4]  # 16 requests admitted at once, 4 prompts prefilled
        assert_answers_as_alone(engine, reqs, together)
        assert len({tuple(c.output_ids) for c in together}) > 4  # the group members sampled apart
    finally:
        engine.shutdown()


def test_union_head_gives_the_engines_bits(threads):
    """The trainer's union head (one product over the batch's support ids) against the engine's
    full-vocabulary head on each row alone, both under the probed plan: the same log-probs bit for
    bit where the probe says a column subset keeps its bits; its gradient is the dense path's to rounding."""
    from support_replay.core.logprobs import union_head_support_logprobs
    from support_replay.core.support import SupportTable
    from support_replay.modeling.invariant_products import cpu_name, invariant_linear, invariant_plan

    gen = torch.Generator().manual_seed(7)
    rows, width, vocab = 37, 64, 384
    plan = invariant_plan("torch", vocab, width, torch.float32, torch.get_num_threads())
    if (
        plan is None or not plan.columns
    ):  # refused, or the trainer takes the full head (tests/modeling/test_invariant_products.py)
        pytest.skip(f"the union head is not exact on this CPU ({cpu_name()}): {plan}")
    product = invariant_linear("torch")
    hidden = torch.randn(rows, width, generator=gen, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, width, generator=gen)).requires_grad_()
    support_rows = [
        np.unique(torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).numpy())
        for _ in range(rows)
    ]
    targets = torch.tensor([int(r[len(r) // 2]) for r in support_rows])
    support = SupportTable.from_rows(support_rows)
    got = union_head_support_logprobs(hidden, weight, targets, support, 0.7, linear=product)
    with torch.no_grad():
        for r in range(rows):
            logits = product(hidden[r : r + 1], weight)
            one = support_logprobs(logits, targets[r : r + 1], SupportTable.from_rows([support_rows[r]]), 0.7)
            assert torch.equal(got[r : r + 1], one), r
    dense = support_logprobs(hidden @ weight.T, targets, support, 0.7)
    grads = torch.autograd.grad(got.sum(), (hidden, weight))
    for g, want in zip(grads, torch.autograd.grad(dense.sum(), (hidden, weight))):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
