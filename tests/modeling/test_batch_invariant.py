"""The batch-invariant forward of true-on-policy mode (modeling/batch_invariant.py): a sequence's logits are the same
bits in the engine (left-padded batches, KV cache, prefill then decode) and in the trainer (right-padded or packed
rows, float32 master weights under a bf16 compute dtype), on any CPU and kernel set."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.core.support import SupportTable
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.model_runner import ModelRunner
from support_replay.errors import ConfigError
from support_replay.kernels import invariant
from support_replay.modeling.batch_invariant import batch_invariant_attention, make_batch_invariant
from support_replay.protocol import GenerateRequest
from tiny_model import assert_answers_as_alone

pytestmark = pytest.mark.float_bits  # bit for bit under every kernel set: CI reruns them under the other two

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]


def _reference_attention(q, k, v, allowed):
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (9, 3, 64), (2, 1, 80)], ids=["tiny", "smollm2", "80"])
def test_a_decode_query_over_a_padded_cache_is_the_causal_forwards_bits(threads, heads, kv_heads, dim):
    """One query over a left-padded cache (random padding, masked columns past it, a neighbour row of noise) gets the
    same bits as the same query in a right-padded causal forward, for every key count from 1 to 129; the forward is
    attention (sdpa's to 1e-5) and its gradient attention's."""
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
    torch.testing.assert_close(full[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(full[1, :100], expected[1, :100], atol=1e-5, rtol=0)
    assert not full[1, 100:].any()  # padding queries: zeros, never NaN
    grads = torch.autograd.grad(full[0].sum() + full[1, :100].sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected[0].sum() + expected[1, :100].sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        for n in range(1, 130):  # the query at position n - 1 sees n keys
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


def test_a_packed_rows_queries_see_their_own_sequences_keys_with_the_engines_bits(threads):
    """A packed row (a prompt, then two responses) under its mask: each response's queries get the bits of the same
    queries in an unpacked row of that prompt and response alone (the engine's cache row)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, prompt, first, second = 6, 2, 32, 7, 5, 9
    total = prompt + first + second
    q, k, v = (torch.randn(1, h, total, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    sees = torch.zeros(1, 1, total, total, dtype=torch.bool)
    sees[0, 0, :, :prompt] = torch.ones(total, prompt, dtype=torch.bool)
    sees[0, 0, :prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    for start, size in ((prompt, first), (prompt + first, second)):
        sees[0, 0, start : start + size, start : start + size] = torch.ones(size, size, dtype=torch.bool).tril()
    packed, _ = batch_invariant_attention(None, q, k, v, sees, scaling=0.2)
    for start, size in ((prompt, first), (prompt + first, second)):
        columns = list(range(prompt)) + list(range(start, start + size))
        causal = torch.ones(len(columns), len(columns), dtype=torch.bool).tril()[None, None]
        alone, _ = batch_invariant_attention(None, q[:, :, columns], k[:, :, columns], v[:, :, columns], causal, 0.2)
        assert torch.equal(packed[0, start : start + size], alone[0, prompt:])


def _decode_and_score(engine_model, trainer_model, prompts, steps=6):
    """The engine's logits of a prefill and ``steps`` greedy decode steps, and the trainer's forward of the finished
    sequences in another order with right padding: ``[(engine row, trainer row)]`` pairs."""
    runner = ModelRunner(engine_model)
    batch, logits = runner.prefill(prompts)
    got, seqs = [logits], [list(p) for p in prompts]
    nxt, pos = logits.argmax(-1), torch.tensor([len(p) for p in prompts])
    for _ in range(steps):
        for s, x in zip(seqs, nxt.tolist()):
            s.append(x)
        logits = runner.decode(batch, nxt, pos)
        pos += 1
        got.append(logits)
        nxt = logits.argmax(-1)
    order = list(reversed(range(len(prompts))))  # another batch order, right padding
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, k in enumerate(order):
        ids[r, : len(seqs[k])] = torch.tensor(seqs[k])
        mask[r, : len(seqs[k])] = 1
    with torch.no_grad():
        full = trainer_model(input_ids=ids, attention_mask=mask).logits.float()
    return [
        (step[k], full[order.index(k), len(prompts[k]) - 1 + t])
        for t, step in enumerate(got)
        for k in range(len(prompts))
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_engine_and_trainer_logits_are_bitwise_equal(tiny_checkpoint, tiny_moe_checkpoint, threads, dtype, moe):
    """The engine's model loaded in ``dtype`` and the trainer's float32 master weights computing in ``dtype``."""
    path = tiny_moe_checkpoint if moe else tiny_checkpoint
    engine_model = make_batch_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval())
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    make_batch_invariant(trainer_model, dtype)
    # decode steps cross 64 and 128 keys; prompts of different lengths pad the cache
    prompts = [[5 + i % 50 for i in range(61)], [11, 12], [20 + i % 30 for i in range(125)]]
    for t, (engine_row, trainer_row) in enumerate(_decode_and_score(engine_model, trainer_model, prompts)):
        assert torch.equal(engine_row, trainer_row), t


def test_deterministic_engine_output_does_not_depend_on_the_batch(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True)).start()
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
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True))
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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_sparse_heads_invariant_dots_give_the_engines_bits(threads, dtype):
    """The trainer's true-on-policy head (each support id's logit by the invariant dot) against the engine's full
    head on each row alone: the same log-probs bit for bit; its gradient is the dense path's to rounding."""
    gen = torch.Generator().manual_seed(7)
    rows, width, vocab = 37, 64, 384
    hidden = torch.randn(rows, width, generator=gen).to(dtype).requires_grad_()
    weight = (0.1 * torch.randn(vocab, width, generator=gen)).requires_grad_()  # float32 master weights
    support_rows = [
        np.unique(torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).numpy())
        for _ in range(rows)
    ]
    targets = torch.tensor([int(r[len(r) // 2]) for r in support_rows])
    support = SupportTable.from_rows(support_rows)
    ids, valid = support.to_padded()
    z = invariant.dots(hidden, weight, ids, valid)
    column = ((ids == targets[:, None]) & valid).to(torch.uint8).argmax(-1)
    got = support_logprobs(z, column, (torch.arange(ids.shape[1]).expand_as(ids), valid), 0.7)
    engine_weight = weight.detach().to(dtype)  # the engine's copy in its dtype
    with torch.no_grad():
        for r in range(rows):
            logits = invariant.linear(hidden[r : r + 1].detach(), engine_weight).float()
            one = support_logprobs(logits, targets[r : r + 1], SupportTable.from_rows([support_rows[r]]), 0.7)
            assert torch.equal(got[r : r + 1], one), r
    dense = support_logprobs(hidden.float() @ weight.T, targets, support, 0.7)
    grads = torch.autograd.grad(got.sum(), (hidden, weight))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for g, want in zip(grads, torch.autograd.grad(dense.sum(), (hidden, weight))):
        torch.testing.assert_close(g.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_a_model_of_an_unknown_layer_kind_is_refused_by_name(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model.config.hidden_act = "gelu"
    with pytest.raises(ConfigError, match="true-on-policy mode: activation 'gelu'"):
        make_batch_invariant(model)
    model.config.hidden_act = "silu"
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    with pytest.raises(ConfigError, match="true-on-policy mode: model.norm is a LayerNorm"):
        make_batch_invariant(model)
    with pytest.raises(ConfigError, match="float32 or bfloat16, not torch.float16"):
        make_batch_invariant(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), torch.float16)
