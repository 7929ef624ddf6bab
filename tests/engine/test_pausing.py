"""Pausing generation between decode steps (engine/pausing.py): weights changed under running requests, each
token sampled and recorded under the weights current when it was sampled."""

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sampled_supports import replayed_diff
from support_replay import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.errors import AbortedError, EngineError
from support_replay.protocol import GenerateRequest, VersionSpan
from support_replay.serving.server import create_app

BEFORE, TOTAL = 5, 12  # tokens sampled before the push, in all


@pytest.fixture(scope="module")
def new_weights(tiny_checkpoint):
    """Every weight moved (the keys and values of every layer change, not only the head), and the model they make."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    state = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    return state, model


@pytest.fixture(scope="module")
def old_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def request(engine) -> GenerateRequest:
    ids = engine.tokenizer("What is 12 plus 7? Think step by step.")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, seed=11)
    return GenerateRequest(ids, params, max_new_tokens=TOTAL, ignore_eos=True, return_sampling_mask=True)


def straddling(engine, state, mode: str, req: GenerateRequest | None = None):
    """One request: ``BEFORE`` tokens under the old weights, paused in ``mode``, the new weights, continued."""
    req = req or request(engine)
    future = engine.submit(req)
    for _ in range(BEFORE - 1):  # the first step admits (one token from the prefill) and decodes one, each later one
        engine.step()
    assert len(engine.batch.rows[0].output_ids) == BEFORE
    pause = engine.pause_generation(mode)
    update = engine.update_weights(state, "v1")
    engine.wait([pause, update])
    assert pause.result() == 1 and update.result() == "v1"
    assert len(engine.batch) == (0 if mode == "retract" else 1)  # retracted: out of the batch, its blocks freed
    engine.wait([engine.continue_generation()])
    engine.wait([future])
    return req, future.result()


def replayed(model, req, completion, start: int, end: int) -> float:
    return replayed_diff(model, req.input_ids, completion.output_ids, completion.support, completion.log_mu, start, end)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_request_straddling_a_push_records_each_token_under_its_version(
    tiny_checkpoint, new_weights, old_model, mode
):
    """Tokens before the push are the old weights' exactly as replayed; after it, ``retract`` samples from the
    new weights on their own keys and values (replayed as closely as any token), while ``in_place`` keeps the old
    weights' keys and values of the prefix, a mismatch the replay sees: the recompute is what makes it hold."""
    state, new_model = new_weights
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0, prefix_cache=False))
    req, completion = straddling(engine, state, mode)
    assert completion.weight_versions == [VersionSpan("default", 0, BEFORE), VersionSpan("v1", BEFORE, TOTAL)]
    assert replayed(old_model, req, completion, 0, BEFORE) < 1e-4
    after = replayed(new_model, req, completion, BEFORE, TOTAL)
    if mode == "retract":
        assert after < 1e-4
    else:
        assert after > 1e-2, f"in_place: stale keys and values should show, largest difference {after:.2e}"


def test_a_pause_that_aborts_fails_running_and_waiting_requests_and_continue_serves_again(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0))
    running = engine.submit(request(engine))
    engine.step()
    waiting = engine.submit(request(engine))  # queued, not admitted: no step since
    paused = engine.pause_generation("abort")
    engine.wait([paused, running, waiting])
    assert paused.result() == 2
    for future in (running, waiting):
        with pytest.raises(AbortedError, match="paused with mode 'abort'|abort mode"):
            future.result()
    later = engine.submit(request(engine))
    for _ in range(3):
        engine.step()
    assert not later.done()  # paused: nothing is admitted until continue
    engine.wait([engine.continue_generation(), later])
    assert len(later.result().output_ids) == TOTAL


@pytest.mark.float_bits  # the deterministic engine
def test_the_deterministic_engine_refuses_an_update_under_an_in_place_pause(tiny_checkpoint, new_weights):
    """True-on-policy mode samples every token from the current weights exactly: stale keys and values under new
    weights are refused by name, and the request goes on under the old weights."""
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0, deterministic=True))
    future = engine.submit(request(engine))
    engine.step()
    pause, update = engine.pause_generation("in_place"), engine.update_weights(new_weights[0], "v1")
    engine.wait([pause, update])
    with pytest.raises(EngineError, match="paused with mode 'in_place'.*retract"):
        update.result()
    engine.wait([engine.continue_generation(), future])
    assert future.result().weight_versions == [VersionSpan("default", 0, TOTAL)]


def test_serve_pauses_retracts_loads_and_continues_as_sglangs_routes(tiny_checkpoint, new_weights, tmp_path):
    """``/pause_generation {"mode": "retract"}``, ``/update_weights_from_disk`` while paused, ``/continue_generation``:
    a request in flight answers with two version spans."""
    save_file({k: v.contiguous() for k, v in new_weights[0].items()}, str(tmp_path / "model.safetensors"))
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0)).start()
    try:
        with TestClient(create_app(engine, weights_dir=str(tmp_path))) as client:
            ids = engine.tokenizer("Count: 1 2 3")["input_ids"]
            body = {
                "input_ids": ids,
                "sampling_params": {"top_k": 8, "max_new_tokens": 400, "ignore_eos": True, "seed": 1},
                "return_sampling_mask": True,
            }
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(client.post, "/generate", json=body)
                while not engine.batch.rows or len(engine.batch.rows[0].output_ids) < 3:
                    pass
                paused = client.post("/pause_generation", json={"mode": "retract"}).json()
                assert paused["status"] == "ok" and paused["requests"] == 1
                loaded = client.post(
                    "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "v1"}
                )
                assert loaded.json()["weight_version"] == "v1"
                assert client.post("/continue_generation", json={}).json()["recomputed"] == 1
                meta = answer.result(timeout=120).json()["meta_info"]
            spans = meta["weight_versions"]
            assert [s["version"] for s in spans] == ["default", "v1"] and spans[-1]["end"] == 400
            assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 3
            refused = client.post("/pause_generation", json={"mode": "sideways"})
            assert refused.status_code in (400, 422) and "mode" in refused.text
    finally:
        engine.shutdown()


def test_a_retracted_moe_request_answers_with_the_routing_its_earlier_tokens_followed(tiny_moe_checkpoint):
    """Routing replay across a push: the recompute routes the prefix again under the new weights; the answer's
    ``routed_experts`` is the recompute's (every fed position), and ``routed_experts_history`` keeps the routing the
    tokens before the push were computed with, as a request never paused computes them."""
    from dataclasses import replace

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    state = {k: v + 0.5 * v.abs().mean() * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    settings = EngineSettings(seed=0, prefix_cache=False)
    engine = Engine.from_pretrained(tiny_moe_checkpoint, settings)
    req = replace(request(engine), return_routed_experts=True)
    _, completion = straddling(engine, state, "retract", req)
    prompt = len(req.input_ids)
    (earlier,) = completion.routed_experts_history
    assert earlier.shape[0] == prompt + BEFORE - 1 and completion.routed_experts.shape[0] == prompt + TOTAL - 1
    unpaused = Engine.from_pretrained(tiny_moe_checkpoint, settings)
    alone = unpaused.submit(replace(req, max_new_tokens=BEFORE))
    unpaused.wait([alone])
    assert (earlier == alone.result().routed_experts).all()  # the same request's first computation
    assert (earlier != completion.routed_experts[: len(earlier)]).any()  # the new weights routed the prefix otherwise
