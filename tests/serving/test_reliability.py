"""A bad request fails alone, limits refuse before a slot is taken, guards refuse before a handler
runs, a repeated request id is answered once, and /metrics counts it all (docs/reliability.md)."""

import threading

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from support_replay import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.engine import sampling_step as engine_module
from support_replay.engine.limits import EngineLimits
from support_replay.errors import AbortedError, EngineError, OverloadedError, RequestError
from support_replay.protocol import GenerateRequest
from support_replay.serving.security import Keys
from support_replay.serving.server import create_app


@pytest.fixture(scope="module")
def deterministic_engine(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True, seed=0)).start()
    yield eng
    eng.shutdown()


def batch(n: int, poison_at: int | None = None, poison_params=None):
    reqs = []
    for i in range(n):
        params = SamplingParams(temperature=1.0, top_k=16, top_p=0.9, seed=1000 + i)
        if i == poison_at:
            params = poison_params
        reqs.append(
            GenerateRequest(
                [5 + i % 7, 40, 77, 9 + i], params, max_new_tokens=6, ignore_eos=True, return_sampling_mask=True
            )
        )
    return reqs


def run_together(engine, reqs):
    """Submit all at once; the deterministic engine's answers do not depend on how they were batched."""
    futures = [engine.submit(r) for r in reqs]
    out = []
    for f in futures:
        try:
            out.append(f.result(timeout=120))
        except EngineError as exc:
            out.append(exc)
    return out


@pytest.mark.float_bits
@pytest.mark.parametrize("where", ["prefill", "sampling"])
def test_an_error_in_one_request_fails_it_alone_and_the_rest_are_bit_identical(
    deterministic_engine, monkeypatch, where
):
    poison = SamplingParams(temperature=1.0, top_k=16, top_p=0.123, seed=7)  # marks the poisoned request
    alone = run_together(deterministic_engine, batch(8))
    if where == "prefill":
        original = deterministic_engine.runner.prefill

        def prefill(prompts, **kw):
            if any(p[-1] == 9 + 3 for p in prompts):  # the prompt of request 3
                raise RuntimeError("injected prefill failure")
            return original(prompts, **kw)

        monkeypatch.setattr(deterministic_engine.runner, "prefill", prefill)
    else:
        original = engine_module.sample_tokens

        def sample(logits, params, *args, **kwargs):
            if any(p.top_p == 0.123 for p in params):
                raise RuntimeError("injected sampling failure")
            return original(logits, params, *args, **kwargs)

        monkeypatch.setattr(engine_module, "sample_tokens", sample)
    crowd = run_together(deterministic_engine, batch(8, poison_at=3, poison_params=poison))
    assert isinstance(crowd[3], EngineError) and crowd[3].status == 500 and f"during {where}" in str(crowd[3])
    for i, (a, b) in enumerate(zip(alone, crowd)):
        if i == 3:
            continue
        assert a.output_ids == b.output_ids and np.array_equal(a.log_mu, b.log_mu) and a.support == b.support, i


def test_limits_refuse_before_a_slot_is_taken(tiny_checkpoint):
    limits = EngineLimits(
        max_new_tokens=32, max_prompt_tokens=64, max_stop_strings=2, max_stop_string_length=8, max_queue=2
    )
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(limits=limits))  # not started: requests stay queued
    ok = GenerateRequest([1, 2, 3], SamplingParams(top_k=8), max_new_tokens=4)
    cases = [
        (GenerateRequest([1] * 65, SamplingParams(top_k=8)), "input_ids: 65 prompt tokens exceed the limit of 64"),
        (
            GenerateRequest([1], SamplingParams(top_k=8), max_new_tokens=33),
            "max_new_tokens: 33 exceeds the limit of 32",
        ),
        (
            GenerateRequest([1], SamplingParams(top_k=8), stop=["a", "b", "c"]),
            "stop: 3 stop strings exceed the limit of 2",
        ),
        (GenerateRequest([1], SamplingParams(top_k=8), stop=["x" * 9]), "stop: a stop string of 9 characters"),
    ]
    for req, message in cases:
        with pytest.raises(RequestError, match=message):
            eng.submit(req).result(timeout=5)
    first, second = eng.submit(ok), eng.submit(ok)
    with pytest.raises(OverloadedError, match="the admission queue is full"):
        eng.submit(ok).result(timeout=5)
    assert eng.stats.requests["refused"] == 4 and eng.stats.requests["overloaded"] == 1
    eng.start()
    assert len(first.result(timeout=60).output_ids) == 4 and len(second.result(timeout=60).output_ids) == 4
    eng.shutdown()


def test_a_repeated_request_id_is_answered_once(deterministic_engine):
    req = GenerateRequest(
        [3, 4, 5], SamplingParams(top_k=8, seed=5), max_new_tokens=5, return_sampling_mask=True, rid="run-a/r0/s1"
    )
    first = deterministic_engine.submit(req)
    again = deterministic_engine.submit(req)  # while the first runs: the same future
    a = first.result(timeout=60)
    later = deterministic_engine.submit(req).result(timeout=60)  # after it finished: its answer
    assert again.result(timeout=60) is a and later is a
    assert deterministic_engine.stats.duplicates >= 2


def test_an_aborted_request_stops_and_frees_its_slot(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint).start()
    long = eng.submit(GenerateRequest([1, 2], SamplingParams(top_k=8), max_new_tokens=500, ignore_eos=True))
    for _ in range(3000):
        if eng.num_running:
            break
        threading.Event().wait(0.01)
    eng.abort(long)
    with pytest.raises(AbortedError):
        long.result(timeout=30)
    assert eng.num_running == 0 and eng.stats.requests["aborted"] == 1
    eng.shutdown()


# ---- the HTTP guards ----------------------------------------------------------------------


@pytest.fixture
def guarded(tiny_checkpoint, tmp_path):
    eng = Engine.from_pretrained(tiny_checkpoint).start()
    app = create_app(
        eng,
        keys=Keys(api="gen-key", admin="admin-key"),
        max_request_bytes=4096,
        weights_dir=tmp_path / "weights",
        allowed_hosts=["127.0.0.1", "localhost", "testserver"],
    )
    (tmp_path / "weights").mkdir()
    with TestClient(app) as client:
        yield client, eng, tmp_path
    eng.shutdown()


GEN = {"Authorization": "Bearer gen-key"}
ADMIN = {"Authorization": "Bearer admin-key"}


def test_body_limit_holds_for_chunked_bodies(guarded):
    client, _, _ = guarded

    def chunks():
        for _ in range(64):
            yield b"x" * 1024

    r = client.post("/generate", content=chunks(), headers={**GEN, "content-type": "application/json"})
    assert r.status_code == 413 and "larger than 4096 bytes" in r.text
    assert (
        client.post("/generate", content=b"y" * 5000, headers={**GEN, "content-type": "application/json"}).status_code
        == 413
    )


def test_mutating_routes_take_json_from_a_known_host_with_the_right_key(guarded):
    client, eng, tmp_path = guarded
    body = {"model_path": str(tmp_path / "weights")}
    # a page in a browser posts text/plain: refused before anything runs
    assert (
        client.post(
            "/update_weights_from_disk", content=str(body), headers={**ADMIN, "content-type": "text/plain"}
        ).status_code
        == 415
    )
    assert (
        client.post("/update_weights_from_disk", json=body, headers={**ADMIN, "host": "evil.example"}).status_code
        == 400
    )
    assert (
        client.post("/update_weights_from_disk", json=body, headers=GEN).status_code == 401
    )  # the generation key is not the admin key
    assert client.post("/generate", json={"input_ids": [1, 2]}).status_code == 401
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    # weights only from under --weights-dir
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)}, headers=ADMIN)
    assert r.status_code == 403 and "is not under the weights directory" in r.text
    torch.save({}, tmp_path / "weights" / "x.pt")
    r = client.post("/update_weights_from_disk", json=body, headers=ADMIN)
    assert r.status_code == 400 and "no .safetensors file" in r.text  # nothing but safetensors is read
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, headers=GEN)
    assert r.status_code == 200


def test_metrics_count_outcomes(guarded):
    client, eng, _ = guarded
    client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}, headers=GEN)
    client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 999999}}, headers=GEN)
    text = client.get("/metrics").text
    assert 'support_replay_requests_total{status="ok"} 1.0' in text
    assert 'support_replay_requests_total{status="refused"} 1.0' in text
    assert "support_replay_generated_tokens_total 3.0" in text and "support_replay_queue_depth 0.0" in text


# ---- the trainer: durable checkpoints, no NaN pushed, failed responses never train ------------

from recipe_helpers import run_config  # noqa: E402
from support_replay.errors import EngineUnavailable, NonFiniteError  # noqa: E402
from support_replay.train import learner as learner_module  # noqa: E402
from support_replay.train import train  # noqa: E402
from support_replay.train.checkpoint import latest_checkpoint, verify_checkpoint  # noqa: E402
from support_replay.train.metrics import read_rows  # noqa: E402


def test_resume_skips_a_damaged_checkpoint_and_a_torn_metrics_line(tiny_checkpoint, tmp_path):
    cfg = dict(num_rollout=2, save=str(tmp_path / "ckpt"), save_interval=1)
    train(run_config(tiny_checkpoint, tmp_path, **cfg))
    ckpt = tmp_path / "ckpt"
    assert verify_checkpoint(ckpt / "rollout_000002") is None and latest_checkpoint(ckpt).name == "rollout_000002"
    with (ckpt / "rollout_000002" / "model.safetensors").open("r+b") as f:  # one flipped byte
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "model.safetensors does not match its checksum" in verify_checkpoint(ckpt / "rollout_000002")
    assert latest_checkpoint(ckpt).name == "rollout_000001"
    metrics = tmp_path / "out" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"rollout": 2, "rew')  # the run died mid-line
    assert len(read_rows(metrics)) == 2
    rows = train(run_config(tiny_checkpoint, tmp_path, resume=True, **{**cfg, "num_rollout": 3}))
    assert [r["rollout"] for r in rows] == [0, 1, 2]  # resumed from 1: rollout 1 again, then 2


def test_a_nan_reward_stops_the_run_before_anything_is_saved(tiny_checkpoint, tmp_path, monkeypatch):
    import rewards_for_tests

    monkeypatch.setattr(rewards_for_tests, "digit_share", lambda prompt, response, label: float("nan"))
    with pytest.raises(NonFiniteError, match=r"rollout 0, sample 0: the reward function returned nan"):
        train(run_config(tiny_checkpoint, tmp_path, save=str(tmp_path / "ckpt"), save_interval=1))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


def test_a_nan_loss_stops_the_run_before_the_step(tiny_checkpoint, tmp_path, monkeypatch):
    original = learner_module.Learner.advantages

    def poisoned(self, samples, old):
        adv, stats = original(self, samples, old)
        adv[5] = float("nan")
        return adv, stats

    monkeypatch.setattr(learner_module.Learner, "advantages", poisoned)
    with pytest.raises(NonFiniteError, match=r"rollout 0, sample 5, response position 0: the loss is nan"):
        train(run_config(tiny_checkpoint, tmp_path, save=str(tmp_path / "ckpt"), save_interval=1))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


def flaky_backend(monkeypatch, failures: dict):
    """The first answers of some requests (by sample index and attempt) never come."""
    from support_replay.backends.local import EngineBackend

    original = EngineBackend.generate

    def generate(self, requests, *, return_exceptions=False):
        out = original(self, requests, return_exceptions=return_exceptions)
        for i, req in enumerate(requests):
            _, rollout, k, attempt = req.rid.rsplit("/", 3)
            if (int(rollout), int(k), int(attempt)) in failures:
                out[i] = EngineUnavailable(f"completion {i}: injected: engine gone")
        return out

    monkeypatch.setattr(EngineBackend, "generate", generate)


def test_a_failed_response_regenerates_its_group(tiny_checkpoint, tmp_path, monkeypatch):
    flaky_backend(monkeypatch, {(0, 5, 0)})  # rollout 0, sample 5 (group 1), first attempt
    rows = train(run_config(tiny_checkpoint, tmp_path, num_rollout=2))
    assert (rows[0]["failed_samples"], rows[0]["regenerated_groups"], rows[0]["dropped_groups"]) == (1, 1, 0)
    assert rows[1]["failed_samples"] == 0 and rows[0]["train_rollout_logprob_abs_diff_max"] < 1e-3


def test_a_failed_response_drops_its_group_and_keeps_batches_whole(tiny_checkpoint, tmp_path, monkeypatch):
    flaky_backend(monkeypatch, {(0, 5, 0), (1, 0, 0), (1, 4, 0)})
    rows = train(run_config(tiny_checkpoint, tmp_path, num_rollout=2, failed_group_policy="drop"))
    assert rows[0]["dropped_groups"] == 1 and rows[0]["optimizer_steps"] == 1  # 4 samples left: one global batch of 4
    assert rows[1]["skipped"] is True and rows[1]["dropped_groups"] == 2  # both groups gone: nothing trains


def test_regeneration_gives_up_and_names_the_group(tiny_checkpoint, tmp_path, monkeypatch):
    flaky_backend(monkeypatch, {(0, 5, a) for a in range(3)})
    with pytest.raises(EngineUnavailable, match=r"rollout 0, group 1: no complete answer after 3 attempts"):
        train(run_config(tiny_checkpoint, tmp_path, num_rollout=1))


def test_poison_requests_get_4xx_and_the_batch_beside_them_is_unchanged(deterministic_engine):
    from poison import POISONS, send_with

    with TestClient(create_app(deterministic_engine)) as client:

        def post(body):
            if isinstance(body, bytes):
                r = client.post("/generate", content=body, headers={"content-type": "application/json"})
            else:
                r = client.post("/generate", json=body)
            return r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

        baseline, _ = send_with(post, 8)
        assert all(status == 200 for status, _, _ in baseline)
        for name, poison in POISONS.items():
            goods, (status, _seconds) = send_with(post, 8, poison)
            assert 400 <= status < 500, (name, status)
            assert goods == baseline, name  # every good answer bit-identical to the run without the poison
