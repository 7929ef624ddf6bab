"""The real SGLang 0.5.23 server (``make sglang``: its PyPI wheel on this machine's CPU torch), as a user starts
it: its own HTTP server, scheduler, ``Qwen3ForCausalLM``, torch-native attention and PyTorch sampler."""

import httpx
import pytest

pytestmark = pytest.mark.slow

MASKED = {"temperature": 1.0, "top_k": 8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}


def test_the_server_answers_with_its_sampling_masks(sglang_server):
    """SGLang's own ``meta_info``: one support per output token holding the sampled id, and its log mu."""
    url, _ = sglang_server
    body = {"input_ids": [1, 2, 3, 4], "return_sampling_mask": True, "sampling_params": MASKED}
    answer = httpx.post(url + "/generate", json=body, timeout=120).json()
    meta = answer["meta_info"]
    masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert len(answer["output_ids"]) == len(masks) == len(logprobs) == 8
    assert meta["output_token_sampling_mask_length"] == 8
    for token, mask, logprob in zip(answer["output_ids"], masks, logprobs):
        assert token in mask and 1 <= len(mask) <= 8 and logprob <= 0.0


def test_a_mask_without_a_finite_top_k_is_refused_by_sglangs_own_rule(sglang_server):
    """SGLang admits ``return_sampling_mask`` only with greedy or a finite top_k (up to 4,096): top-p alone is
    refused, in a 200 whose body is an error object."""
    url, _ = sglang_server
    body = {"input_ids": [1, 2, 3], "return_sampling_mask": True, "sampling_params": {**MASKED, "top_k": -1}}
    answer = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert "return_sampling_mask requires top_k" in answer["error"]["message"]


@pytest.mark.float_bits  # log(1) is 0 exactly: a singleton support
def test_greedy_supports_are_singletons_with_log_mu_zero(sglang_server):
    url, _ = sglang_server
    body = {"input_ids": [5, 6, 7], "return_sampling_mask": True, "sampling_params": {**MASKED, "temperature": 0.0}}
    meta = httpx.post(url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert all(len(mask) == 1 for mask in meta["output_token_sampling_mask"])
    assert all(logprob == 0.0 for logprob in meta["output_token_sampling_logprobs"])
