"""Tensor- and context-parallel paths against the single-device result, on 2 gloo processes."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bf16_gradients import assert_rounded_once, exact_support_grad

from support_replay import SupportError, SupportTable, full_logprobs_and_entropy, support_logprobs
from support_replay.core.parallel import (
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_response_rows,
    context_parallel_restore,
    vocab_parallel_full_logprobs_and_entropy,
    vocab_parallel_support_logprobs,
    vocab_shard,
)

WORLD = 2


def make_problem(rows=23, vocab=41, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    lists = []
    for t in range(rows):
        size = [1, 2, 5, vocab, 3][t % 5]
        lists.append(torch.randperm(vocab, generator=g)[:size].tolist())
    # a row whose support lies entirely in the second shard
    lists[1] = [vocab - 1, vocab - 2]
    targets = torch.tensor([r[0] for r in lists])
    return logits, targets, SupportTable.from_lists(lists)


def single_device(logits, targets, table, temperature):
    x = logits.clone().requires_grad_()
    lp = support_logprobs(x, targets, table, temperature)
    flp, ent = full_logprobs_and_entropy(x, targets, temperature)
    w = torch.linspace(-1, 1, len(targets))
    (lp * w + flp * w.flip(0) + ent * 0.3).sum().backward()
    return lp.detach(), flp.detach(), ent.detach(), x.grad


def _worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        logits, targets, table = make_problem()
        temperature = 0.7
        lp_ref, flp_ref, ent_ref, grad_ref = single_device(logits, targets, table, temperature)

        # tensor parallel: this rank holds one vocab shard
        start, stop = vocab_shard(logits.shape[1], rank, WORLD)
        local = logits[:, start:stop].clone().requires_grad_()
        lp = vocab_parallel_support_logprobs(local, targets, table, temperature, start)
        flp, ent = vocab_parallel_full_logprobs_and_entropy(local, targets, temperature, start, chunk_rows=5)
        w = torch.linspace(-1, 1, len(targets))
        (lp * w + flp * w.flip(0) + ent * 0.3).sum().backward()
        torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(flp, flp_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(local.grad, grad_ref[:, start:stop], atol=1e-6, rtol=1e-5)
        # bf16 logits: each shard's gradient entries the exact gradient rounded once (confident tokens included)
        sharp = logits.clone()
        sharp[torch.arange(len(targets)), targets] += 12
        bf = sharp.to(torch.bfloat16)[:, start:stop].clone().requires_grad_()
        (vocab_parallel_support_logprobs(bf, targets, table, temperature, start) * w).sum().backward()
        exact = exact_support_grad(sharp.to(torch.bfloat16), targets, table.to_lists(), temperature, w)
        assert_rounded_once(bf.grad, exact[:, start:stop], whole_rows=False)

        # context parallel: logits of a whole sequence split by position, both layouts
        prompt_len, response_len = 5, logits.shape[0]
        seq_len = prompt_len + response_len
        full_pos_logits = torch.randn(seq_len, logits.shape[1], generator=torch.Generator().manual_seed(1))
        scoring = full_pos_logits[prompt_len - 1 : prompt_len - 1 + response_len]
        x_ref = scoring.clone().requires_grad_()
        ref = support_logprobs(x_ref, targets, table, temperature)
        ref.sum().backward()
        for layout in ("contiguous", "zigzag"):
            rows_per_rank = []
            for r in range(WORLD):
                pos = context_parallel_positions(seq_len, r, WORLD, layout)
                rows_per_rank.append(context_parallel_response_rows(pos, prompt_len, response_len)[1])
            pos = context_parallel_positions(seq_len, rank, WORLD, layout)
            local_idx, rows = context_parallel_response_rows(pos, prompt_len, response_len)
            held = full_pos_logits[torch.from_numpy(pos)].clone().requires_grad_()
            mine = support_logprobs(held[torch.from_numpy(local_idx)], targets[rows], table.select(rows), temperature)
            mine.sum().backward()
            assert torch.equal(mine.detach(), ref.detach()[rows])  # same rows, same function: bitwise
            torch.testing.assert_close(held.grad[torch.from_numpy(local_idx)], x_ref.grad[rows])
            gathered = context_parallel_gather(mine, rows_per_rank, response_len)
            assert torch.equal(gathered, ref.detach())
        results[rank] = "ok"
    except Exception as exc:  # report to the parent instead of hanging the other rank
        results[rank] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.processes
def test_tensor_and_context_parallel_match_single_device(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=WORLD, join=True)
    assert dict(results) == {0: "ok", 1: "ok"}


def test_layouts_cover_every_position_once():
    for seq_len in (8, 13, 64):
        for cp in (1, 2, 4):
            for layout in ("contiguous", "zigzag"):
                held = np.concatenate([context_parallel_positions(seq_len, r, cp, layout) for r in range(cp)])
                assert sorted(held.tolist()) == list(range(seq_len))
    assert context_parallel_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


def test_response_rows_and_restore():
    local_idx, rows = context_parallel_response_rows(np.array([0, 1, 6, 7]), prompt_len=3, response_len=5)
    # position p scores response row p - (prompt_len - 1)
    assert local_idx.tolist() == [2] and rows.tolist() == [4]
    local_idx, rows = context_parallel_response_rows(np.arange(2, 9), prompt_len=3, response_len=5)
    assert local_idx.tolist() == [0, 1, 2, 3, 4] and rows.tolist() == [0, 1, 2, 3, 4]
    parts = [torch.tensor([1.0, 3.0]), torch.tensor([2.0])]
    assert context_parallel_restore(parts, [[0, 2], [1]], 3).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(SupportError, match="not covered"):
        context_parallel_restore(parts, [[0, 2], [1]], 4)
    with pytest.raises(SupportError, match="layout"):
        context_parallel_positions(4, 0, 2, "ring")


def test_vocab_shards_partition_the_vocabulary():
    for vocab, world in ((41, 2), (10, 3), (151936, 8)):
        bounds = [vocab_shard(vocab, r, world) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_tensor_parallelism_refuses_models_it_cannot_split():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from support_replay.errors import ConfigError
    from support_replay.modeling.tensor_parallel import check_tensor_parallel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no Llama-style decoder layers to split"):
        check_tensor_parallel(gpt2, 2)
    smollm2_like = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=1,
            hidden_size=36,
            intermediate_size=63,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=50,
        )
    )
    with pytest.raises(
        ConfigError, match="--tensor-model-parallel-size=2: the model's num_attention_heads=9 is not a multiple of it"
    ):
        check_tensor_parallel(smollm2_like, 2)
    check_tensor_parallel(smollm2_like, 3)  # 9 heads, 3 key/value heads, an MLP of 63: three ranks split it
