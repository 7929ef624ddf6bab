"""Converters from SGLang and vLLM payloads, on fixtures built from SPEC section 6."""

import math

import numpy as np
import pytest

from support_replay import SupportTable, WireError, wire


def sglang_meta(mask, logprobs, lengths=True):
    meta = {"output_token_sampling_mask": mask, "output_token_sampling_logprobs": logprobs}
    if lengths:
        meta["output_token_sampling_mask_length"] = [len(r) for r in mask]
    return meta


def test_sglang_selected_mode():
    # ordered by descending weight, as SGLang returns them
    meta = sglang_meta([[7, 2, 9], [4]], [math.log(0.5), 0.0])
    table, lp = wire.from_sglang_meta_info(meta, output_ids=[2, 4], vocab_size=10)
    assert table.to_lists() == [[2, 7, 9], [4]]
    assert lp.dtype == np.float32 and lp.tolist() == pytest.approx([math.log(0.5), 0.0])


def test_sglang_support_mode_picks_the_selected_entry():
    meta = sglang_meta([[7, 2, 9], [4]], [[-0.2, -1.9, -3.0], [0.0]])
    _, lp = wire.from_sglang_meta_info(meta, output_ids=[2, 4])
    assert lp.tolist() == pytest.approx([-1.9, 0.0])


def test_sglang_binary_mask():
    table = SupportTable.from_lists([[2, 7, 9], [4]])
    meta = {"output_token_sampling_mask": wire.to_json(table, 10, [2, 4]), "output_token_sampling_logprobs": [-1.0, 0.0]}
    got, _ = wire.from_sglang_meta_info(meta, output_ids=[2, 4], vocab_size=10)
    assert got == table


def test_sglang_missing_mask_names_the_router():
    with pytest.raises(WireError, match="router on the path .* may have stripped it"):
        wire.from_sglang_meta_info({"output_token_logprobs": []}, output_ids=[])


@pytest.mark.parametrize(
    "meta, ids, message",
    [
        (sglang_meta([[1], [2]], [0.0]), [1, 2], "1 entries for 2 tokens"),
        (sglang_meta([[1], [2]], [0.0, 0.0]), [1, 2, 3], "2 support rows for 3 output tokens"),
        (sglang_meta([[1], [2, 3]], [0.0, -0.5]), [1, 4], "row 1: selected token 4 is not in its support"),
        (sglang_meta([[1], []], [0.0, 0.0]), [1, 2], r"output_token_sampling_mask\[1\]: empty support"),
        (sglang_meta([[1], [3, 3]], [0.0, -0.5]), [1, 3], "duplicate id 3"),
        (sglang_meta([[1], [3]], [0.0, float("nan")]), [1, 3], r"\[1\]: log-prob nan"),
        (sglang_meta([[1], [3]], [0.0, float("-inf")]), [1, 3], r"\[1\]: log-prob -inf"),
        (sglang_meta([[1], [3, "x"]], [0.0, -1.0]), [1, 3], "list of integer token ids"),
        ({**sglang_meta([[1], [3, 4]], [0.0, -1.0]), "output_token_sampling_mask_length": [1, 3]}, [1, 3], r"length\[1\]=3"),
        ({"output_token_sampling_mask": [[1]]}, [1], "no output_token_sampling_logprobs"),
    ],
)
def test_sglang_rejections(meta, ids, message):
    with pytest.raises(WireError, match=message):
        wire.from_sglang_meta_info(meta, output_ids=ids)


def test_sglang_vocab_bound():
    with pytest.raises(WireError, match="outside the vocabulary"):
        wire.from_sglang_meta_info(sglang_meta([[12]], [0.0]), output_ids=[12], vocab_size=10)


def test_vllm_native_mask():
    table, lp = wire.from_vllm(
        [5, 1], sampling_mask=[{"token_ids": [1, 5, 8]}, [1]], sampled_logprobs=[-0.7, 0.0], vocab_size=10
    )
    assert table.to_lists() == [[1, 5, 8], [1]]
    assert lp.tolist() == pytest.approx([-0.7, 0.0])


def test_vllm_processed_logprobs():
    top = [{5: -0.3, 1: -1.5, 8: -9999.0, 2: -9999.0}, {1: 0.0, 3: -9999.0, 4: -9999.0, 6: -9999.0}]
    table, lp = wire.from_vllm([1, 1], top_logprobs=top, requested_logprobs=4)
    assert table.to_lists() == [[1, 5], [1]]
    assert lp.tolist() == pytest.approx([-1.5, 0.0])


def test_vllm_fails_closed_when_every_returned_entry_is_finite():
    top = [{5: -0.3, 1: -1.5}]
    with pytest.raises(WireError, match="support may be larger"):
        wire.from_vllm([1], top_logprobs=top, requested_logprobs=2)


def test_vllm_rejections():
    with pytest.raises(WireError, match="neither sampling_mask nor processed top_logprobs"):
        wire.from_vllm([1])
    with pytest.raises(WireError, match="selected token 2 has no finite"):
        wire.from_vllm([2], top_logprobs=[{1: 0.0, 2: -9999.0}], requested_logprobs=5)
    with pytest.raises(WireError, match="1 entries for 2 output tokens"):
        wire.from_vllm([1, 2], top_logprobs=[{1: 0.0}])
    with pytest.raises(WireError, match="selected token 3 is not in its support"):
        wire.from_vllm([3], sampling_mask=[[1, 2]], sampled_logprobs=[-0.1])
