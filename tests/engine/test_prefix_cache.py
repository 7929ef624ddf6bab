"""The prefix cache: a prompt that begins with a finished sequence prefills only its rest, with the
logits and keys/values of a whole prefill (float tolerance), log mu that a fresh forward reproduces;
entries live inside the KV budget and give way to admissions; updates, /flush_cache and the
deterministic engine keep none."""

import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.model_runner import cached_columns
from support_replay.engine.prefix_cache import CANDIDATES, CHUNK, MIN_MATCH, PrefixCache
from support_replay.protocol import GenerateRequest

PARAMS = SamplingParams(temperature=1.0, top_k=16, top_p=0.9, seed=3)


def first_turn(engine: Engine):
    prompt = engine.tokenizer("System: you are a careful assistant. User: count to ten.")["input_ids"]
    (c,) = engine.generate([GenerateRequest(prompt, PARAMS, max_new_tokens=12, ignore_eos=True)])
    return prompt, c


def assert_rows_equal(pool, a, b, rows_a, rows_b, lengths, atol=1e-4):
    for i, j, n in zip(rows_a, rows_b, lengths):
        for (k, v), (k2, v2) in zip(pool.read(a.tables[i], n), pool.read(b.tables[j], n)):
            torch.testing.assert_close(k, k2, atol=atol, rtol=0)
            torch.testing.assert_close(v, v2, atol=atol, rtol=0)


def test_a_prefill_reading_a_cached_prefix_is_a_whole_prefill(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    prompt, c = first_turn(engine)
    full = prompt + c.output_ids + engine.tokenizer(" User: and back.")["input_ids"]
    entry, n = engine.prefix_cache.match(full)
    assert n == len(prompt) + len(c.output_ids) - 1  # every fed position (the last token was never fed)
    pool, page = engine.runner.pool, engine.runner.pool.block_size
    reserve = [-(-(len(full) + 4) // page)]
    after_cache, after_logits = engine.runner.prefill([full], reserve=reserve, cached=[(entry, n)])
    assert not set(after_cache.tables[0]) & set(entry.blocks) and after_cache.pitches == reserve  # its own run
    assert all(pool.refs[b] == 1 for b in entry.blocks)  # the entry's hold alone
    whole_cache, whole_logits = engine.runner.prefill([full])
    torch.testing.assert_close(after_logits, whole_logits, atol=1e-4, rtol=0)
    assert_rows_equal(pool, after_cache, whole_cache, [0], [0], [len(full)])
    after_cache.release()
    assert all(pool.refs[b] == 1 for b in entry.blocks)


def test_prompts_admitted_together_compute_only_the_columns_past_their_cached_prefixes(tiny_checkpoint):
    """A batch of prompts with hits of unlike lengths, twice the same prompt and one without a hit:
    one forward over the longest rest; each row equals its whole prefill and lies in its own run."""
    engine = Engine.from_pretrained(tiny_checkpoint)
    prompt, c = first_turn(engine)
    context = prompt + c.output_ids
    tail = engine.tokenizer(" User: and back.")["input_ids"]
    prompts = [context + tail, context[:-3] + tail + tail, context + tail, list(range(40, 52))]
    matches = [engine.prefix_cache.match(p) for p in prompts]
    hits = [n for _, n in matches]
    assert hits[:3] == [len(context) - 1, len(context) - 3, len(context) - 1] and hits[3] == 0
    starts = cached_columns([len(p) for p in prompts], hits)
    rest = len(prompts[1]) - hits[1]  # the longest rest
    assert starts == [len(prompts[0]) - rest, hits[1], len(prompts[2]) - rest, 0]
    widths = []
    forward = engine.runner._forward
    engine.runner._forward = lambda ids, *a: widths.append(ids.shape) or forward(ids, *a)
    page = engine.runner.pool.block_size
    reserve = [-(-(len(p) + 4) // page) for p in prompts]
    cached = [None if e is None else (e, n) for e, n in matches]
    batch, logits = engine.runner.prefill(prompts, reserve=reserve, cached=cached)
    assert widths == [(3, rest)]  # the two identical prompts once, the rest columns only
    assert batch.pitches == [max(reserve)] * 4 and len({b for t in batch.tables for b in t}) == sum(reserve)
    for i, p in enumerate(prompts):
        alone, alone_logits = engine.runner.prefill([p])
        torch.testing.assert_close(logits[i : i + 1], alone_logits, atol=1e-4, rtol=0)
        assert_rows_equal(engine.runner.pool, batch, alone, [i], [0], [len(p)])
        alone.release()


def test_cached_columns():
    assert cached_columns([10, 12], [0, 0]) == [0, 0]  # no hit: every column computed
    assert cached_columns([10, 12], [9, 0]) == [0, 0]  # a fresh prompt as long as any: nothing to skip
    assert cached_columns([10, 12, 11], [9, 11, 4]) == [3, 5, 4]  # the longest rest is 7
    assert cached_columns([30, 5], [28, 0]) == [25, 0]  # a short fresh prompt within the rest columns


def test_a_sessions_next_turn_reuses_its_context_and_replays(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    prompt, c = first_turn(engine)
    full = prompt + c.output_ids + engine.tokenizer(" User: and back.")["input_ids"]
    before = engine.prefix_cache.stats.prefilled_tokens
    req = GenerateRequest(full, PARAMS, max_new_tokens=8, return_sampling_mask=True)
    (second,) = engine.generate([req])
    stats = engine.prefix_cache.stats
    assert stats.hits == 1 and stats.prefilled_tokens - before == len(full) - (len(prompt) + len(c.output_ids) - 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([full + second.output_ids])).logits[0].float()
    rows = logits[len(full) - 1 : len(full) - 1 + second.num_tokens]
    again = support_logprobs(rows, torch.tensor(second.output_ids), second.support, 1.0)
    torch.testing.assert_close(again, torch.tensor(second.log_mu), atol=1e-4, rtol=0)


@pytest.mark.float_bits
def test_entries_give_way_within_the_budget_and_are_dropped_on_updates(tiny_checkpoint, tmp_path):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(max_total_tokens=600))
    prompt, _ = first_turn(engine)
    assert engine.prefix_cache.tokens > 0
    big = GenerateRequest(list(range(5, 105)), PARAMS, max_new_tokens=210, ignore_eos=True)
    (c,) = engine.generate([big])  # 580 of the 600 alone (320 reserved, 100 prefilled, 160 gathered): the entries went
    assert c.num_tokens == 210 and engine.prefix_cache.stats.evicted >= 1
    assert engine.prefix_cache.tokens <= engine.kv_budget.max_total_tokens
    first_turn(engine)
    assert engine.prefix_cache.entries
    engine.wait([engine.update_weight_version("v2")])
    assert not engine.prefix_cache.entries and engine.prefix_cache.tokens == 0
    first_turn(engine)
    assert engine.flush_prefix_cache() >= 1
    engine.step()
    assert not engine.prefix_cache.entries
    deterministic = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True))
    first_turn(deterministic)
    assert not deterministic.prefix_cache.enabled and not deterministic.prefix_cache.entries


def test_a_flush_asked_while_the_loop_waits_comes_before_the_next_request(tiny_checkpoint):
    """A serving loop idles inside the scheduler's wait for work: a /flush_cache asked then, and a request sent right
    after it, find the cache emptied before that request is admitted (no hit on what the flush dropped)."""
    engine = Engine.from_pretrained(tiny_checkpoint).start()
    try:
        prompt, _ = first_turn(engine)
        for _ in range(5):  # each time the loop is waiting for work (its wait is 50 ms)
            time.sleep(0.02)
            hits = engine.prefix_cache.stats.hits
            assert engine.flush_prefix_cache() >= 1
            engine.generate([GenerateRequest(prompt, PARAMS, max_new_tokens=2, ignore_eos=True)])
            assert engine.prefix_cache.stats.hits == hits
    finally:
        engine.shutdown()


def test_rollouts_without_updates_keep_their_rows_in_place_as_entries_give_way(tiny_checkpoint):
    """GRPO-shaped rollouts with no weight update between them: every finished row's blocks stay cached among the
    freed ones, and the pool's untouched tail runs out (round 9 here): then the oldest entries give way, and each
    group's rows still get runs at one pitch (attended in place) instead of scattered blocks."""
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(max_total_tokens=1600))
    pool, in_place = engine.runner.pool, []
    allocate_rows = pool.allocate_rows
    pool.allocate_rows = lambda sizes: (rows := allocate_rows(sizes), in_place.append(rows is not None))[0]
    for r in range(12):
        engine.generate(
            [
                GenerateRequest(
                    list(range(10 + 7 * r + g, 30 + 7 * r + g)),
                    SamplingParams(temperature=1.0, top_k=8, seed=10 * r + 2 * g + j),
                    max_new_tokens=12,
                    ignore_eos=True,
                )
                for g in range(2)
                for j in range(2)
            ]
        )
    assert pool._high > pool.blocks - 12 and engine.prefix_cache.stats.evicted > 0  # the tail ran out
    assert in_place == [True] * 12 and engine.prefix_cache.entries


def test_routing_captured_for_cached_positions_is_kept_with_them(tiny_moe_checkpoint):
    """A mixture of experts: a finished sequence that captured its routing leaves it with its entry; a
    later request that captures routing and begins with it reports those experts for the cached
    positions and this forward's for the rest (every fed position, as without the cache)."""
    engine = Engine.from_pretrained(tiny_moe_checkpoint)
    prompt = list(range(5, 25))
    ask = dict(max_new_tokens=6, ignore_eos=True, return_sampling_mask=True, return_routed_experts=True)
    (a,) = engine.generate([GenerateRequest(prompt, PARAMS, **ask)])
    full = prompt + a.output_ids + [30, 31, 32]
    entry, n = engine.prefix_cache.match(full, routing=True)
    assert entry is not None and n == len(prompt) + a.num_tokens - 1 and entry.routing.shape[0] == len(entry.ids)
    hits = engine.prefix_cache.stats.hits
    (b,) = engine.generate([GenerateRequest(full, PARAMS, **ask)])
    assert engine.prefix_cache.stats.hits == hits + 1
    assert b.routed_experts.shape == (len(full) + b.num_tokens - 1, *a.routed_experts.shape[1:])
    assert np.array_equal(b.routed_experts[:n], a.routed_experts[:n])  # the cached positions' own experts
    engine.flush_prefix_cache()
    engine.step()
    (fresh,) = engine.generate([GenerateRequest(full, PARAMS, **ask)])
    same = (fresh.routed_experts[n : len(full)] == b.routed_experts[n : len(full)]).all(axis=(1, 2))
    assert same.mean() >= 0.9  # the rest: this forward's routing (a whole prefill's, to float rounding)
    plain = Engine.from_pretrained(tiny_moe_checkpoint)
    plain.generate([GenerateRequest(prompt, PARAMS, max_new_tokens=6, ignore_eos=True)])  # no routing kept
    assert plain.prefix_cache.match(full, routing=True) == (None, 0) and plain.prefix_cache.match(full)[1] > 0


class NoScan(OrderedDict):
    """Entries that refuse to be walked: a lookup must find its entry without comparing every one."""

    def items(self):
        raise AssertionError("the lookup walked every entry")

    values = __iter__ = items


def filled_cache(sequences, page=16):
    from support_replay.engine.block_pool import BlockPool

    pool = BlockPool(num_layers=1, block_size=page, max_tokens=page * (sum(-(-len(s) // page) for s in sequences) + 1))
    cache, block = PrefixCache(pool), 1
    for ids in sequences:
        blocks = list(range(block, block + -(-len(ids) // page)))
        pool.refs[blocks] += 1
        cache.store(list(ids), blocks)
        pool.release(blocks)
        block += len(blocks)
    return cache


def brute_force(cache, prompt):
    """The longest common prefix over every entry, capped at len(prompt) - 1 (what the scan found)."""
    best = 0
    for key in list(OrderedDict.keys(cache.entries)):
        n = 0
        while n < min(len(key), len(prompt) - 1) and key[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return best if best >= MIN_MATCH else 0


def test_a_lookup_among_16000_entries_compares_a_few_not_all():
    """Issue 55, finding 8: ``match`` compared the prompt with every entry in Python (33 ms per prompt at
    16,000 entries); now the chained hashes of whole chunks find the entries that share the prompt's start."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 49152, 16).tolist() for _ in range(16000)]
    cache = filled_cache(sequences)
    cache.entries = NoScan(cache.entries)
    for i in (0, 7999, 15999):
        entry, n = cache.match(sequences[i] + [5, 6, 7])
        assert n == 16 and entry.ids.tolist() == sequences[i]
    assert cache.match(rng.integers(0, 49152, 40).tolist()) == (None, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=12), st.data())
def test_the_indexed_match_is_a_true_common_prefix_within_a_chunk_of_the_longest(sequences, data):
    """Over small alphabets (many shared chunks): the match is a true common prefix, below the longest by less
    than a chunk, and the longest wherever at most ``CANDIDATES`` entries share its deepest chunk."""
    cache = filled_cache(sequences)
    prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=48))
    entry, n = cache.match(prompt)
    best = brute_force(cache, prompt)
    if entry is None:
        assert best < MIN_MATCH + CHUNK and n == 0
        return
    assert entry.ids[:n].tolist() == prompt[:n] and MIN_MATCH <= n <= best < n + CHUNK
    if len(cache.entries) <= CANDIDATES:
        assert n == best


def test_evicted_entries_leave_the_index_and_a_row_of_older_weights_is_not_stored():
    """Entries are keyed by the weights they were computed with: a row admitted before an update
    (``epoch`` 0) that ends after it is not stored, whatever the order of the two."""
    cache = filled_cache([list(range(20)), list(range(20, 40))])
    assert cache.match(list(range(30)))[1] == 20
    cache.evict_oldest()  # the least recently used: the second, the first was just matched
    assert cache.match(list(range(20, 45))) == (None, 0) and cache.match(list(range(30)))[1] == 20
    cache.new_weights()
    assert cache.entries == {} and cache.index == {} and cache.epoch == 1
    cache.pool.refs[[1, 2]] += 1
    cache.store(list(range(20)), [1, 2], epoch=0)  # admitted under the old weights
    assert cache.entries == {}
    cache.store(list(range(20)), [1, 2], epoch=1)
    assert cache.match(list(range(30)))[1] == 20
