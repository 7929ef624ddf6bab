"""Requests that used to tie up the engine thread (issue: review finding 6): their per-step cost is
now linear in what they return, checked by counting the work, not by timing it."""

import numpy as np
import pytest
import torch

from support_replay import SamplingParams, SupportTable, support_logprobs
from support_replay.core.logprobs import support_row_logprobs
from support_replay.core.penalties import _repeated_sum_table, repeated_sum
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest


@pytest.mark.float_bits
@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_support_row_logprobs_are_the_selected_tokens_bits_in_linear_memory(n):
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(1000, generator=gen) * 4
    ids = torch.randperm(1000, generator=gen)[:n]
    row = support_row_logprobs(logits, ids, 0.7)
    assert row.shape == (n,)
    # the same bits as support_logprobs scoring each id as the selected token of that support
    each = support_logprobs(logits.expand(n, -1), ids, SupportTable.from_rows([ids.numpy()] * n), 0.7)
    assert torch.equal(row, each)
    assert abs(float(torch.logsumexp(row.double(), 0))) < 1e-5


def test_stop_strings_decode_a_few_tokens_per_step_not_the_whole_output(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    lengths = []
    decode = engine.tokenizer.decode
    engine.tokenizer.decode = lambda ids, **kw: lengths.append(len(ids)) or decode(ids, **kw)
    req = GenerateRequest(
        [5, 6, 7], SamplingParams(top_k=20, seed=4), max_new_tokens=64, stop=["\x00never"], ignore_eos=True
    )
    out = engine.generate([req])[0]
    assert out.num_tokens == 64
    engine.tokenizer.decode = decode
    during = lengths[:-1]  # the last call decodes the whole answer once, for its text
    assert (
        len(during) >= 64 and max(during) <= 2 * 4
    )  # at most 4 tokens waiting on a character; was 1, 2, ..., 64 tokens: quadratic in the answer
    assert out.text == decode(out.output_ids, skip_special_tokens=True)


def test_a_stop_string_found_incrementally_cuts_where_the_whole_decode_does(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    base = GenerateRequest([5, 6, 7], SamplingParams(top_k=20, seed=9), max_new_tokens=40, ignore_eos=True)
    full = engine.generate([base])[0]
    text = decode_all = engine.tokenizer.decode(full.output_ids, skip_special_tokens=True)
    for cut in (len(text) // 3, len(text) // 2, len(text) - 3):
        stop = text[cut : cut + 3]
        got = engine.generate(
            [GenerateRequest(base.input_ids, base.params, max_new_tokens=40, ignore_eos=True, stop=[stop])]
        )[0]
        assert (
            got.finish_reason == {"type": "stop", "matched": stop} and got.text == decode_all[: decode_all.find(stop)]
        )


def test_the_frequency_table_is_built_a_logarithmic_number_of_times_and_keeps_its_bits():
    _repeated_sum_table.cache_clear()
    for count in range(1, 2000):
        repeated_sum(0.37, torch.tensor([count, 0]))
    assert _repeated_sum_table.cache_info().misses <= 12  # was one table per new maximum: 1,999
    table, acc = _repeated_sum_table(0.37, 2048), np.float32(0)
    for c in range(1, 2049):  # one fp32 addition at a time, as SGLang's scatter_add accumulates
        acc = np.float32(acc + np.float32(0.37))
        assert table[c] == acc, c
