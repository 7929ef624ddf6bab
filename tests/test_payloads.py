"""Engine payloads parsed by the backends that speak them, then validated once on entry."""

import math

import numpy as np
import pytest

from support_replay import SamplingParams, SupportTable, WireError, wire
from support_replay.backends.sglang import SGLangBackend
from support_replay.backends.vllm import parse_native_mask, parse_processed_logprobs
from support_replay.protocol import Completion, GenerateRequest, validate_completion


def sglang_meta(mask, logprobs, lengths=True):
    meta = {"output_token_sampling_mask": mask, "output_token_sampling_logprobs": logprobs}
    if lengths:
        meta["output_token_sampling_mask_length"] = len(mask)
    return meta


def from_sglang(meta, output_ids, vocab_size=1000):
    """What SGLangBackend does with one /generate result: parse, then validate once."""
    req = GenerateRequest([1], SamplingParams(top_k=8), return_sampling_mask=True)
    c = SGLangBackend("http://unused", vocab_size).completion({"output_ids": output_ids, "meta_info": meta}, req)
    c = validate_completion(c, req, vocab_size)
    return c.support, c.log_mu


def from_vllm(output_ids, *, sampling_mask=None, sampled_logprobs=None, top_logprobs=None, requested_logprobs=0, vocab_size=1000):
    if sampling_mask is not None:
        support, log_mu = parse_native_mask(output_ids, sampling_mask, sampled_logprobs)
    else:
        support, log_mu = parse_processed_logprobs(output_ids, top_logprobs, requested_logprobs)
    req = GenerateRequest([1], SamplingParams(top_k=8), return_sampling_mask=True)
    validate_completion(Completion(output_ids, {}, log_mu=log_mu, support=support), req, vocab_size)
    return support, log_mu


def test_sglang_selected_mode():
    # ordered by descending weight, as SGLang returns them
    meta = sglang_meta([[7, 2, 9], [4]], [math.log(0.5), 0.0])
    table, lp = from_sglang(meta, [2, 4], 10)
    assert table.to_lists() == [[2, 7, 9], [4]]
    assert lp.dtype == np.float32 and lp.tolist() == pytest.approx([math.log(0.5), 0.0])


def test_sglang_support_mode_picks_the_selected_entry():
    meta = sglang_meta([[7, 2, 9], [4]], [[-0.2, -1.9, -3.0], [0.0]])
    _, lp = from_sglang(meta, [2, 4])
    assert lp.tolist() == pytest.approx([-1.9, 0.0])


def test_sglang_binary_mask():
    table = SupportTable.from_lists([[2, 7, 9], [4]])
    meta = {"output_token_sampling_mask": wire.to_json(table, 10, [2, 4]), "output_token_sampling_logprobs": [-1.0, 0.0]}
    got, _ = from_sglang(meta, [2, 4], 10)
    assert got == table


def test_sglang_missing_mask_names_the_router():
    with pytest.raises(WireError, match="router on the path .* may have stripped it"):
        from_sglang({"output_token_logprobs": []}, [1])


@pytest.mark.parametrize(
    "meta, ids, message",
    [
        (sglang_meta([[1], [2]], [0.0]), [1, 2], "1 entries for 2 tokens"),
        (sglang_meta([[1], [2]], [0.0, 0.0]), [1, 2, 3], "2 support rows for 3 output tokens"),
        ({**sglang_meta([[1], [2]], [0.0, 0.0]), "output_token_sampling_mask_length": [1, 1]}, [1, 2], "SGLang sends the number of mask rows, 2"),
        (sglang_meta([[1], [2, 3]], [0.0, -0.5]), [1, 4], "row 1: selected token 4 is not in its support"),
        (sglang_meta([[1], []], [0.0, 0.0]), [1, 2], r"output_token_sampling_mask\[1\]: empty support"),
        (sglang_meta([[1], [3, 3]], [0.0, -0.5]), [1, 3], "duplicate id 3"),
        (sglang_meta([[1], [3, 5]], [0.0, float("nan")]), [1, 3], r"token 1: log mu nan is not a finite value"),
        (sglang_meta([[1], [3, 5]], [0.0, float("-inf")]), [1, 3], r"token 1: log mu -inf is not a finite value"),
        (sglang_meta([[1], [3, "x"]], [0.0, -1.0]), [1, 3], "list of integer token ids"),
        ({"output_token_sampling_mask": [[1]]}, [1], "no output_token_sampling_logprobs"),
    ],
)
def test_sglang_rejections(meta, ids, message):
    with pytest.raises(WireError, match=message):
        from_sglang(meta, ids)


def test_sglang_vocab_bound():
    with pytest.raises(WireError, match="outside the vocabulary"):
        from_sglang(sglang_meta([[12]], [0.0]), [12], 10)


def test_vllm_native_mask():
    table, lp = from_vllm(
        [5, 1], sampling_mask=[{"token_ids": [1, 5, 8]}, [1]], sampled_logprobs=[-0.7, 0.0], vocab_size=10
    )
    assert table.to_lists() == [[1, 5, 8], [1]]
    assert lp.tolist() == pytest.approx([-0.7, 0.0])


def test_vllm_processed_logprobs():
    top = [{5: -0.3, 1: -1.5, 8: -9999.0, 2: -9999.0}, {1: 0.0, 3: -9999.0, 4: -9999.0, 6: -9999.0}]
    table, lp = from_vllm([1, 1], top_logprobs=top, requested_logprobs=4)
    assert table.to_lists() == [[1, 5], [1]]
    assert lp.tolist() == pytest.approx([-1.5, 0.0])


def test_vllm_fails_closed_when_every_returned_entry_is_finite():
    top = [{5: -0.3, 1: -1.5}]
    with pytest.raises(WireError, match="support may be larger"):
        from_vllm([1], top_logprobs=top, requested_logprobs=2)


def test_vllm_rejections():
    with pytest.raises(WireError, match="no processed top_logprobs: ask logprobs=K"):
        from_vllm([1])
    with pytest.raises(WireError, match="selected token 2 has no finite"):
        from_vllm([2], top_logprobs=[{1: 0.0, 2: -9999.0}], requested_logprobs=5)
    with pytest.raises(WireError, match="1 entries for 2 output tokens"):
        from_vllm([1, 2], top_logprobs=[{1: 0.0}])
    with pytest.raises(WireError, match="selected token 3 is not in its support"):
        from_vllm([3], sampling_mask=[[1, 2]], sampled_logprobs=[-0.1])
