"""The KV memory budget (engine/kv_budget.py): admission waits until a request fits, the cache's
peak never passes the budget on any growth path, a request that can never fit is refused with its
numbers, and the answers are those of an engine without a budget."""

import numpy as np
import pytest

from support_replay import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.block_pool import BlockPool
from support_replay.engine.kv_budget import KVBudget, column_need, largest_batch
from support_replay.engine.model_runner import ModelRunner
from support_replay.engine.paged_cache import PagedCache
from support_replay.errors import ConfigError, RequestError
from support_replay.protocol import GenerateRequest


def requests(lengths, max_new=6):
    return [
        GenerateRequest(
            [5 + (i * 7 + j) % 50 for j in range(n)],
            SamplingParams(top_k=20, top_p=0.9, seed=i),
            max_new_tokens=max_new,
            ignore_eos=True,
            return_sampling_mask=True,
        )
        for i, n in enumerate(lengths)
    ]


@pytest.fixture
def peaks(monkeypatch):
    """The KV positions held at every moment that can be a peak: each block taken (blocks held), each
    prefill (held + its padded keys and values), each decode step's gather (held + one layer's copy)."""
    seen = []
    real_allocate, real_attended, real_prefill = BlockPool.allocate, PagedCache.attended, ModelRunner._prefill

    def allocate(self, n):
        ids = real_allocate(self, n)
        seen.append(self.used * self.block_size)
        return ids

    def attended(self, layer, group=None):
        out = real_attended(self, layer, group)
        storage = self.pool.storage[layer]
        held = 0 if self._buffer is None else self._buffer.numel()
        copy = held // (2 * storage.shape[1] * storage.shape[4])  # positions of one layer's gathered copy
        seen.append(self.pool.used * self.pool.block_size + -(-copy // self.pool.num_layers))
        return out

    def prefill(self, prompts, hits):
        seen.append(self.pool.used * self.pool.block_size + len(prompts) * max(map(len, prompts)))
        return real_prefill(self, prompts, hits)

    monkeypatch.setattr(BlockPool, "allocate", allocate)
    monkeypatch.setattr(PagedCache, "attended", attended)
    monkeypatch.setattr(ModelRunner, "_prefill", prefill)
    return seen


@pytest.mark.float_bits
def test_a_long_prompt_beside_many_short_ones_stays_within_the_budget(tiny_checkpoint, peaks):
    budget = 2400
    free = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True, max_total_tokens=10**7))
    tight = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True, max_total_tokens=budget))
    reqs = requests([300] + [3] * 31)  # one long prompt beside short ones: each holds its own length in blocks
    alone = free.generate(reqs)
    peaks.clear()
    prefills = []
    real_prefill = tight.runner._prefill
    tight.runner._prefill = lambda prompts, hits: prefills.append(len(prompts)) or real_prefill(prompts, hits)
    out = tight.generate(reqs)
    assert peaks and max(peaks) <= budget  # every block taken, every prefill, every gather
    assert len(prefills) > 1  # all 32 at once would pass it (32 x 320 positions): the rest waited for rows to leave
    for a, b in zip(alone, out):  # waiting changed when each ran, not what it sampled
        assert a.output_ids == b.output_ids and np.array_equal(a.log_mu, b.log_mu) and a.support == b.support


def test_requests_wait_for_room_and_none_fails(tiny_checkpoint, peaks):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(max_total_tokens=400))
    futures = engine.submit_all(requests([20] * 24, max_new=10))  # each reserves 2 blocks of 16, its prefill 20
    engine.wait(futures)
    assert all(f.exception() is None for f in futures) and max(peaks) <= 400
    assert engine.stats.requests["ok"] == 24


def test_a_request_that_can_never_fit_is_refused_with_its_numbers(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(max_total_tokens=100))
    future = engine.submit(requests([60], max_new=10)[0])
    with pytest.raises(
        RequestError,
        match=r"60 prompt tokens \+ their reservation of 80 KV positions, the prefill's 60 and a decode step's "
        r"gathered 40 need 180 positions, more than this engine's --max-total-tokens 100 \(\d+ bytes each\)",
    ):
        future.result()


def test_a_reservation_is_whole_blocks_of_its_own_length_and_the_peak_counts_each_part():
    assert column_need(10, 5, 16) == 16 and column_need(10, 6, 16) == 32 and column_need(10, 5, 1) == 16
    budget = KVBudget(1000, 8, layers=4)
    # held and growing 100, two reservations, a prefill of 20, the gathered copy of 3 rows x 32 over 4 layers
    assert budget.peak(100, [16, 32], 20, rows=3, width=32) == 100 + 48 + 20 + 24


def test_the_default_budget_is_a_share_of_available_memory_and_the_largest_batch_follows(tiny_checkpoint):
    from support_replay.engine.kv_budget import COLOCATED_SHARE, SERVE_SHARE, available_bytes, kv_bytes_per_token

    engine = Engine.from_pretrained(tiny_checkpoint)
    per_token = kv_bytes_per_token(engine.runner.model)
    assert per_token == 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads of 16, fp32
    assert (
        abs(engine.kv_budget.max_total_tokens - available_bytes() * SERVE_SHARE // per_token)
        < 0.1 * engine.kv_budget.max_total_tokens
    )
    colocated = Engine.from_pretrained(
        tiny_checkpoint, EngineSettings(kv_share=COLOCATED_SHARE)
    ).kv_budget.max_total_tokens
    assert colocated < engine.kv_budget.max_total_tokens
    # each: 20 reserved, 10 prefilled, 20 / 2 layers of the gathered copy
    assert largest_batch(KVBudget(1000, 8, layers=2), prompt_tokens=10, max_new_tokens=9) == 1000 // (20 + 10 + 10)


def test_the_flag_bounds_the_in_process_engine_and_is_refused_for_a_remote_one(tiny_checkpoint, tmp_path):
    from recipe_helpers import parts, run_config
    from support_replay.errors import ConfigError

    _, rollouts = parts(tiny_checkpoint, run_config(tiny_checkpoint, tmp_path, max_total_tokens=5000))
    assert rollouts.engine.kv_budget.max_total_tokens == 5000
    rollouts.close()
    with pytest.raises(ConfigError, match="--max-total-tokens=5000: bounds the in-process engine"):
        run_config(tiny_checkpoint, tmp_path, max_total_tokens=5000, rollout_url="http://127.0.0.1:1")


def test_prefills_group_prompts_of_like_length(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    batches = []
    real = engine.runner._prefill
    engine.runner._prefill = lambda prompts, hits: (
        batches.append(sorted(len(p) for p in prompts)) or real(prompts, hits)
    )
    reqs = requests([200] + [4] * 10 + [5] * 3)
    engine.generate(reqs)
    assert batches == [[4] * 10 + [5] * 3, [200]]  # was one batch padded to 200 positions 14 times
    batches.clear()
    group = [GenerateRequest([5, 6, 7, 8], SamplingParams(top_k=20, seed=i), max_new_tokens=2) for i in range(8)]
    engine.generate(group)
    assert batches == [[4]]  # a GRPO group: one prompt, prefilled once


def test_a_long_row_holds_only_its_own_blocks_so_short_ones_fit_beside_it(tiny_checkpoint, peaks):
    """One 300-token request among 63 short ones, all admitted at once: each row holds its own length in
    blocks (336 and 64 positions), where a rectangle of slots would make all 64 as long as the longest."""
    reserved = 336 + 63 * 64
    gathered = 64 * 336 // 2  # a decode step's copy: every row at the longest width, one of the 2 layers
    budget = reserved + 63 * 16 + gathered  # the bucket of short prompts is the larger prefill
    assert 64 * 336 > budget - gathered  # the rectangle alone would not fit
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(max_total_tokens=budget))
    prefills = []
    real = engine.runner._prefill
    engine.runner._prefill = lambda prompts, hits: prefills.append(len(prompts)) or real(prompts, hits)
    out = engine.generate(requests([300] + [16] * 63, max_new=32))
    assert all(c.num_tokens == 32 for c in out) and max(peaks) <= budget
    assert len(prefills) == 2 and prefills[1] == 1  # one admission: the short bucket, the long prompt


def test_mem_fraction_static_leaves_sglangs_pool():
    """SGLang 0.5.23: pool = free after loading - free before x (1 - fraction), in positions."""
    from support_replay.engine.kv_budget import fraction_tokens

    gib = 2**30
    # 20 GiB free before, 2 GiB of weights loaded: 0.4 keeps 12 GiB for the rest, the pool is 18 - 12 = 6 GiB
    assert fraction_tokens(0.4, 20 * gib, 18 * gib, 1024) == 6 * gib // 1024
    with pytest.raises(ConfigError, match="mem_fraction_static=0.1: leaves no KV pool"):
        fraction_tokens(0.1, 20 * gib, 17 * gib, 1024)
    with pytest.raises(ConfigError, match="must be in \\(0, 1\\)"):
        fraction_tokens(1.5, 20 * gib, 18 * gib, 1024)


def test_the_decode_line_comes_every_interval_steps():
    from support_replay.engine.decode_log import DecodeLog

    log = DecodeLog(3)
    lines = [log.step(running=4, tokens=40, budget=400, queued=2) for _ in range(7)]
    assert [line is not None for line in lines] == [False, False, True, False, False, True, False]
    head = "Decode batch, #running-req: 4, #token: 40, token usage: 0.10, gen throughput (token/s): "
    assert lines[2].startswith(head)
    assert lines[2].endswith(", #queue-req: 2")
    assert all(line is None for line in (DecodeLog(0).step(1, 1, 1, 0) for _ in range(5)))
