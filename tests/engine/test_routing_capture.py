"""The engine's routing capture: every fed position's experts, prompt and output, as one forward routes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams
from support_replay.backends.local import EngineBackend
from support_replay.engine import Engine, EngineSettings
from support_replay.errors import RequestError, WireError
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.modeling.moe import install_routing
from support_replay.protocol import GenerateRequest, validate_completion

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def requests(routing: bool, n: int = 5):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    return [
        GenerateRequest(
            prompts[i % len(prompts)],
            SamplingParams(temperature=1.0, top_p=0.9, seed=i),
            max_new_tokens=7,
            return_sampling_mask=True,
            return_routed_experts=routing and i != 2,
        )
        for i in range(n)
    ]


def test_capture_covers_every_fed_position_as_one_forward_routes_it(tiny_moe_checkpoint):
    engine = Engine.from_pretrained(tiny_moe_checkpoint, EngineSettings(deterministic=True, linear_kernel="torch"))
    backend = EngineBackend(engine)
    captured = backend.generate(requests(True))
    plain = backend.generate(requests(False))
    assert [c.output_ids for c in captured] == [c.output_ids for c in plain]  # capture changes no token
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_checkpoint, dtype=torch.float32).eval()
    control = install_routing(reference)
    make_batch_invariant(reference)
    for i, (req, c) in enumerate(zip(requests(True), captured)):
        if not req.return_routed_experts:
            assert c.routed_experts is None
            continue
        assert c.routed_experts.shape == (len(req.input_ids) + c.num_tokens - 1, 2, 2)
        control.record_next()
        with torch.no_grad():
            reference(torch.tensor([req.input_ids + c.output_ids]))
        assert np.array_equal(control.stacked()[:-1].numpy(), c.routed_experts), i


def test_a_dense_model_refuses_routing_by_name(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint)
    with pytest.raises(RequestError, match="return_routed_experts: this model has no experts"):
        EngineBackend(engine).generate(requests(True, 1))


def test_a_completion_whose_routing_does_not_fit_fails_closed(tiny_moe_checkpoint):
    engine = Engine.from_pretrained(tiny_moe_checkpoint)
    shape = engine.runner.routing.shape
    req = requests(True, 1)[0]
    good = EngineBackend(engine).generate([req])[0]
    validate_completion(good, req, engine.vocab_size, 0, shape)
    cases = [
        (good.routed_experts[:-1], "routing for 9 positions, expected 10"),
        (good.routed_experts[:, :1], "routing for 1 layers, the model has 2"),
        (np.where(np.arange(2) == 1, 8, good.routed_experts), "position 0 layer 0: expert id 8 outside \\[0, 8\\)"),
        (None, "routed experts were requested but the response carries none"),
    ]
    for routed, match in cases:
        good.routed_experts = routed
        with pytest.raises(WireError, match=match):
            validate_completion(good, req, engine.vocab_size, 0, shape)
