"""The KV memory budget (engine/kv_budget.py): admission waits until a request fits, the cache's
peak never passes the budget on any growth path, a request that can never fit is refused with its
numbers, and the answers are those of an engine without a budget."""

import numpy as np
import pytest

from support_replay import SamplingParams
from support_replay.engine import Engine
from support_replay.engine import slot_cache as slot_cache_module
from support_replay.engine.kv_budget import KVBudget, largest_batch, plan_shape
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
    """Every reservation's peak: the positions held plus the new buffers while they are copied."""
    seen = []
    real = slot_cache_module.SlotCache.reserve

    def watched(self, rows, columns, like):
        before = (self.slots, self.capacity)
        real(self, rows, columns, like)
        after = (self.slots, self.capacity)
        if after != before:
            seen.append(before[0] * before[1] + after[0] * after[1])

    monkeypatch.setattr(slot_cache_module.SlotCache, "reserve", watched)
    return seen


def test_a_long_prompt_beside_many_short_ones_stays_within_the_budget(tiny_checkpoint, peaks):
    budget = 2400
    free = Engine.from_pretrained(tiny_checkpoint, deterministic=True, max_total_tokens=10**7)
    tight = Engine.from_pretrained(tiny_checkpoint, deterministic=True, max_total_tokens=budget)
    reqs = requests([300] + [3] * 31)  # one long prompt beside short ones: the rectangle makes every slot long
    alone = free.generate(reqs)
    peaks.clear()
    prefills = []
    real_prefill = tight.runner._prefill
    tight.runner._prefill = lambda prompts: prefills.append(len(prompts)) or real_prefill(prompts)
    out = tight.generate(reqs)
    assert peaks and max(peaks) <= budget  # every growth, held + new
    assert len(prefills) > 1  # all 32 at once would pass it (32 x 320 positions): the rest waited for rows to leave
    for a, b in zip(alone, out):  # waiting changed when each ran, not what it sampled
        assert a.output_ids == b.output_ids and np.array_equal(a.log_mu, b.log_mu) and a.support == b.support


def test_requests_wait_for_room_and_none_fails(tiny_checkpoint, peaks):
    engine = Engine.from_pretrained(tiny_checkpoint, max_total_tokens=400)
    futures = engine.submit_all(requests([20] * 24, max_new=10))  # each reserves 31 columns and 40 for its prefill
    engine.wait(futures)
    assert all(f.exception() is None for f in futures) and max(peaks) <= 400
    assert engine.stats.requests["ok"] == 24


def test_a_request_that_can_never_fit_is_refused_with_its_numbers(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, max_total_tokens=100)
    future = engine.submit(requests([60], max_new=10)[0])
    with pytest.raises(
        RequestError,
        match=r"60 prompt tokens \+ their reservation of 71 KV positions and the prefill's 120 need 191 positions, "
        r"more than this engine's --max-total-tokens 100 \(\d+ bytes each\)",
    ):
        future.result()


def test_growth_never_passes_the_budget_and_doubles_where_it_fits():
    assert plan_shape((16, 64), 17, 64, 64, None) == (32, 64)  # no budget: the dimension that ran out doubles
    assert plan_shape((16, 64), 17, 64, 64, 16 * 64 + 32 * 64) == (32, 64)
    assert plan_shape((16, 64), 17, 64, 64, 16 * 64 + 32 * 64 - 1) == (17, 64)  # only as far as needed
    assert plan_shape((16, 64), 16, 65, 64, 10**9) == (16, 128)
    assert plan_shape((0, 0), 3, 10, 64, 10**9) == (3, 10)


def test_the_default_budget_is_a_share_of_available_memory_and_the_largest_batch_follows(tiny_checkpoint):
    from support_replay.engine.kv_budget import COLOCATED_SHARE, SERVE_SHARE, available_bytes, kv_bytes_per_token

    engine = Engine.from_pretrained(tiny_checkpoint)
    per_token = kv_bytes_per_token(engine.runner.model)
    assert per_token == 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads of 16, fp32
    assert (
        abs(engine.kv_budget.max_total_tokens - available_bytes() * SERVE_SHARE // per_token)
        < 0.1 * engine.kv_budget.max_total_tokens
    )
    colocated = Engine.from_pretrained(tiny_checkpoint, kv_share=COLOCATED_SHARE).kv_budget.max_total_tokens
    assert colocated < engine.kv_budget.max_total_tokens
    assert largest_batch(KVBudget(1000, 8), prompt_tokens=10, max_new_tokens=9) == 1000 // (20 + 20)


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
    engine.runner._prefill = lambda prompts: batches.append(sorted(len(p) for p in prompts)) or real(prompts)
    reqs = requests([200] + [4] * 10 + [5] * 3)
    engine.generate(reqs)
    assert batches == [[4] * 10 + [5] * 3, [200]]  # was one batch padded to 200 positions 14 times
    batches.clear()
    group = [GenerateRequest([5, 6, 7, 8], SamplingParams(top_k=20, seed=i), max_new_tokens=2) for i in range(8)]
    engine.generate(group)
    assert batches == [[4]]  # a GRPO group: one prompt, prefilled once


def test_a_long_row_gone_leaves_its_room_to_the_next_admissions(tiny_checkpoint, peaks):
    """One 300-token request among short ones: once it has left, the cache holds only what the rest
    reserved, so the waiting short requests are admitted together instead of ten at a time."""
    engine = Engine.from_pretrained(tiny_checkpoint, max_total_tokens=3 * 333 * 11)
    prefills = []
    real = engine.runner._prefill
    engine.runner._prefill = lambda prompts: prefills.append(len(prompts)) or real(prompts)
    reqs = requests([300] + [16] * 63, max_new=32)
    out = engine.generate(reqs)
    assert all(c.num_tokens == 32 for c in out) and max(peaks) <= 3 * 333 * 11
    assert (
        len(prefills) <= 4 and max(prefills) > 32
    )  # was 8 prefills of at most 11: the rectangle kept the long row's length


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
