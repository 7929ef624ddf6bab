"""The in-process engine on a tiny random Qwen3: capture, continuous batching, stops, capacity."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.engine import Engine, EngineSettings
from support_replay.errors import CapacityError, EngineError, RequestError
from support_replay.protocol import GenerateRequest, VersionSpan


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def prompts(engine, n):
    texts = ["What is 12 plus 7?", "Compute 3 times 4.", "The quick brown fox", "Numbers: 0 1 2 3", "Reinforcement"]
    return [engine.tokenizer(texts[i % len(texts)] * (1 + i % 3))["input_ids"] for i in range(n)]


def rescore(model, prompt_ids, result, temperature):
    ids = torch.tensor([prompt_ids + result.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    start = len(prompt_ids) - 1
    scoring = logits[start : start + len(result.output_ids)]
    return support_logprobs(scoring, torch.tensor(result.output_ids), result.support, temperature)


def test_concurrent_capture_matches_a_fresh_forward(engine, reference_model):
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i)
        for i, (t, k, p) in enumerate(
            [(1.0, 20, 0.9), (0.7, 50, 0.8), (1.3, 5, 1.0), (1.0, 100, 0.95), (1.0, 1, 1.0), (0.9, 30, 0.7)] * 2
        )
    ]
    reqs = [
        GenerateRequest(p_ids, prm, max_new_tokens=6 + 3 * (i % 4), return_sampling_mask=True, return_logprob=True)
        for i, (p_ids, prm) in enumerate(zip(prompts(engine, 12), params))
    ]
    # staggered submission: later requests join a running batch (continuous batching)
    futures = []
    for r in reqs:
        futures.append(engine.submit(r))
        time.sleep(0.01)
    results = [f.result(timeout=60) for f in futures]
    for req, res in zip(reqs, results):
        assert len(res.output_ids) == len(res.log_mu) == res.support.num_rows == len(res.full_logprobs)
        res.support.validate(engine.vocab_size, selected=res.output_ids)
        assert max(res.support.sizes()) <= max(req.params.top_k, 1)
        again = rescore(reference_model, req.input_ids, res, req.params.temperature)
        torch.testing.assert_close(again, torch.tensor(res.log_mu), atol=1e-4, rtol=0)
        if req.params.top_k == 1:
            assert res.support.sizes().tolist() == [1] * len(res.output_ids) and set(res.log_mu) == {0.0}
    # supports actually vary: top-p binds somewhere
    sizes = torch.cat([torch.from_numpy(r.support.sizes()) for r in results])
    assert len(set(sizes.tolist())) > 3


def test_same_seed_same_batch_reproduces(engine):
    reqs = [
        GenerateRequest(p, SamplingParams(top_k=40, top_p=0.9, seed=7 + i), max_new_tokens=8)
        for i, p in enumerate(prompts(engine, 4))
    ]
    a = engine.generate(reqs)
    b = engine.generate(reqs)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


def test_evaluation_requests_capture_nothing(engine):
    res = engine.generate(
        [GenerateRequest(prompts(engine, 1)[0], SamplingParams(top_p=0.9, top_k=10), max_new_tokens=4)]
    )[0]
    assert res.support is None and res.log_mu is None and len(res.output_ids) == 4


def test_stop_token_and_stop_string(engine):
    base = GenerateRequest(prompts(engine, 1)[0], SamplingParams(temperature=0.0), max_new_tokens=12)
    greedy = engine.generate([base])[0].output_ids
    stop_tok = greedy[3]
    first = greedy.index(stop_tok)
    res = engine.generate([GenerateRequest(base.input_ids, base.params, max_new_tokens=12, stop_token_ids=[stop_tok])])[
        0
    ]
    assert res.output_ids == greedy[: first + 1] and res.finish_reason == {"type": "stop", "matched": stop_tok}
    text = engine.tokenizer.decode(greedy, skip_special_tokens=True)
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    res = engine.generate([GenerateRequest(base.input_ids, base.params, max_new_tokens=12, stop=[stop_str])])[0]
    assert res.finish_reason["type"] == "stop" and res.finish_reason["matched"] == stop_str
    assert stop_str not in res.text


def test_capacity_overflow_fails_only_that_request(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(sampling_mask_max_tokens=4)).start()
    try:
        p = prompts(eng, 3)
        with pytest.raises(RequestError, match="top_k=8 exceeds sampling_mask_max_tokens=4"):
            eng.submit(GenerateRequest(p[0], SamplingParams(top_k=8), return_sampling_mask=True)).result()
        bad = eng.submit(
            GenerateRequest(p[1], SamplingParams(top_p=0.999), max_new_tokens=5, return_sampling_mask=True)
        )
        good = eng.submit(GenerateRequest(p[2], SamplingParams(top_k=4), max_new_tokens=5, return_sampling_mask=True))
        with pytest.raises(CapacityError, match="exceeds sampling_mask_max_tokens=4"):
            bad.result(timeout=30)
        ok = good.result(timeout=30)
        assert len(ok.output_ids) == 5 and ok.support.max_size() <= 4
    finally:
        eng.shutdown()


def test_weight_update_waits_and_bumps_version(tiny_checkpoint, tmp_path):
    eng = Engine.from_pretrained(tiny_checkpoint).start()
    try:
        req = GenerateRequest(prompts(eng, 1)[0], SamplingParams(temperature=0.0), max_new_tokens=6)
        before = eng.generate([req])[0]
        state = {k: v.clone() for k, v in eng.runner.model.state_dict().items()}
        state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"]) * 5
        from safetensors.torch import save_file

        save_file({"lm_head.weight": state["lm_head.weight"]}, str(tmp_path / "model.safetensors"))
        running = eng.submit(GenerateRequest(req.input_ids, req.params, max_new_tokens=20))
        version = eng.update_weights_from_disk(tmp_path, "step-1").result(timeout=30)
        finished = running.result(timeout=30)  # under the old weights, all of it
        assert finished.weight_versions == [VersionSpan("default", 0, len(finished.output_ids))]
        after = eng.generate([req])[0]
        assert version == "step-1" and after.weight_version == "step-1" and after.output_ids != before.output_ids
        # without a name the weights change and the version stays, as in SGLang
        assert eng.update_weights_from_disk(tmp_path).result(timeout=30) == "step-1"
        with pytest.raises(RequestError, match="unknown parameter 'nope'"):
            eng.update_weights({"nope": torch.zeros(1)}).result(timeout=30)
    finally:
        eng.shutdown()


def test_a_colocated_weight_push_returns_without_waiting_for_requests(tiny_checkpoint):
    """Without the loop thread, ``wait`` on an update runs the engine's steps here; the step that applies it
    must not then block on the empty queue (the scheduler's poll) before the push returns."""
    eng = Engine.from_pretrained(tiny_checkpoint)
    blocking = []
    take = eng.scheduler.take
    eng.scheduler.take = lambda room, block, *a: blocking.append(block) or take(room, block, *a)
    state = {"lm_head.weight": eng.runner.model.state_dict()["lm_head.weight"] * 2}
    update = eng.update_weights(state, "step-1")
    eng.wait([update])
    assert update.result() == "step-1" and eng.weight_version == "step-1"
    assert blocking == [True, False]  # the first step finds the update; the step that applies it does not block


def test_bad_requests():
    with pytest.raises(RequestError, match="input_ids: the prompt is empty"):
        GenerateRequest([])
    with pytest.raises(RequestError, match="max_new_tokens"):
        GenerateRequest([1], max_new_tokens=0)


def test_a_list_is_admitted_in_one_prefill_and_the_engine_restarts(tiny_checkpoint):
    """``generate`` queues its requests together: a running loop admits all of them in one
    prefill (a GRPO group shares its prompt's prefill) instead of taking the first alone; an
    engine that was shut down starts again instead of stranding the next request."""
    eng = Engine.from_pretrained(tiny_checkpoint).start()
    calls = []
    prefill = eng.runner.prefill
    eng.runner.prefill = lambda batch, **kw: calls.append(len(batch)) or prefill(batch, **kw)
    try:
        group = [
            GenerateRequest([5, 6, 7, 8], SamplingParams(top_k=20, seed=i), max_new_tokens=4, ignore_eos=True)
            for i in range(8)
        ]
        for _ in range(5):
            calls.clear()
            assert all(len(c.output_ids) == 4 for c in eng.generate(group, timeout=30))
            assert calls == [8]
        eng.shutdown()
        assert eng.generate(group[:2], timeout=30)[1].output_ids  # restarted
    finally:
        eng.shutdown()


def test_a_failed_decode_step_fails_its_requests_and_the_engine_serves_on(tiny_checkpoint):
    """Stepping in the caller's thread, as the loop does: a decode step that raises fails the
    running requests with a named error, and the next requests are served."""
    eng = Engine.from_pretrained(tiny_checkpoint)
    decode = eng.runner.decode
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated kernel failure")
        return decode(*args, **kw)

    eng.runner.decode = broken
    req = GenerateRequest([5, 6, 7], SamplingParams(top_k=20, seed=1), max_new_tokens=5, ignore_eos=True)
    with pytest.raises(EngineError, match="internal engine error during decode: simulated kernel failure"):
        eng.generate([req], timeout=30)
    assert len(eng.generate([req], timeout=30)[0].output_ids) == 5
