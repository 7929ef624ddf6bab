"""The server review's findings (docs/reliability.md, "Hostile clients"), each as the probe that
found it: every one of these answered wrongly before its fix."""

import os
import threading
import time

import pytest
from fastapi.testclient import TestClient

from support_replay.engine import Engine, EngineSettings
from support_replay.errors import ConfigError, EngineUnavailable
from support_replay.serving.security import Keys, exposure_warnings
from support_replay.serving.server import create_app

API = {"Authorization": "Bearer api-key"}


def raw_request(app, method: str, raw_path: str, body: bytes = b"{}", headers: dict | None = None) -> tuple[int, bytes]:
    """One request straight into the ASGI app with its path exactly as written (``curl --path-as-is``):
    an HTTP client would normalise ``..`` away before sending."""
    import asyncio
    from urllib.parse import unquote

    path = unquote(raw_path)
    hdrs = [
        (b"host", b"testserver"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": raw_path.encode(),
        "query_string": b"",
        "headers": hdrs,
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.fixture
def api_key_only(tiny_checkpoint, tmp_path):
    """A server with an API key and no admin key, loading weights from under ``tmp_path/weights``."""
    engine = Engine.from_pretrained(tiny_checkpoint).start()
    (tmp_path / "weights").mkdir()
    app = create_app(engine, keys=Keys(api="api-key"), weights_dir=tmp_path / "weights", allowed_hosts=["testserver"])
    with TestClient(app) as client:
        yield client, engine, tmp_path
    engine.shutdown()


# ---- finding 2: an API key alone left the admin routes open ----------------------------------


def test_admin_routes_fall_back_to_the_api_key(api_key_only):
    client, engine, _ = api_key_only
    assert client.post("/update_weight_version", json={"new_version": "forged"}).status_code == 401  # was 200
    assert engine.weight_version != "forged"
    assert client.post("/update_weight_version", json={"new_version": "v2"}, headers=API).status_code == 200
    assert Keys(api="a").header(admin=True) == {"Authorization": "Bearer a"}  # what our trainer and router send


def test_weights_from_disk_with_no_key_on_an_open_address_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--weights-dir on 0.0.0.0 with no key"):
        exposure_warnings("0.0.0.0", Keys(), tmp_path)
    assert exposure_warnings("127.0.0.1", Keys(), tmp_path) == []
    warnings = exposure_warnings("0.0.0.0", Keys(), None)  # finding 10: said nothing before
    assert any("no API key" in w for w in warnings) and any("Host header is not checked" in w for w in warnings)
    assert exposure_warnings("10.1.2.3", Keys(api="k"), tmp_path) == []


# ---- finding 3: a path with '..' passed the guard and was normalised into an admin route ------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../update_weight_version",
        "/v1/%2e%2e/update_weight_version",
        "//update_weight_version",
        "/./update_weight_version",
        "/v1%2f..%2fupdate_weight_version",
    ],
)
def test_paths_not_in_normal_form_are_refused_before_any_guard(api_key_only, path):
    client, engine, _ = api_key_only
    status, body = raw_request(client.app, "POST", path, b'{"new_version": "forged"}', API)
    assert status == 400 and b"not in normal form" in body
    assert engine.weight_version != "forged"
    assert (
        raw_request(client.app, "POST", "/update_weight_version", b'{"new_version": "v3"}', API)[0] == 200
    )  # the normal path works


def test_the_router_refuses_them_too(tiny_checkpoint):
    import httpx

    from support_replay.serving.router import Router, create_router_app

    seen = []
    router = Router(["http://engine:1"], keys=Keys(api="api-key"))
    app = create_router_app(router, allowed_hosts=["testserver"])
    router.client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda req: seen.append(req.url.path) or httpx.Response(200, json={}))
    )
    status, body = raw_request(app, "POST", "/v1/../update_weight_version", b'{"new_version": "x"}', API)
    assert status == 400 and seen == []  # was forwarded, and httpx normalised it into the admin route


# ---- round three, finding 1: an encoded '?' or '#' passed the router's admin check ------------------


@pytest.mark.parametrize(
    "path",
    ["/update_weight_version%3F", "/update_weight_version%3f", "/flush_cache%23", "/update_weight_version%253F",
     "/load_lora_adapter%3Fx=1", "/update_weights_from_disk%23frag"],
)  # fmt: skip
def test_an_encoded_query_or_fragment_cannot_reach_an_admin_route_through_the_router(path):
    """With an API key and an admin key on the router and a keyless engine behind it, ``/update_weight_version%3F``
    passed as an API route (its decoded path is not an admin path), and httpx parsed the forwarded ``/...?`` again,
    so the engine ran ``/update_weight_version``: it answered 200 and the version became 'forged'."""
    import httpx

    from support_replay.serving.router import Router, create_router_app

    seen = []
    router = Router(["http://engine:1"], keys=Keys(api="api-key", admin="admin-key"))
    app = create_router_app(router, allowed_hosts=["testserver"])
    router.client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda req: seen.append(req.url.path) or httpx.Response(200, json={}))
    )
    status, body = raw_request(app, "POST", path, b'{"new_version": "forged"}', API)
    assert status == 400 and b"not in normal form" in body and seen == []
    assert raw_request(app, "POST", "/generate", b"{}", API)[0] == 200 and seen == ["/generate"]  # a plain path


def test_an_encoded_query_or_fragment_is_refused_by_the_engine_too(api_key_only):
    client, engine, _ = api_key_only
    for path in ("/update_weight_version%3F", "/update_weight_version%23"):
        status, body = raw_request(client.app, "POST", path, b'{"new_version": "forged"}', API)
        assert status == 400 and b"not in normal form" in body
    assert engine.weight_version != "forged"


# ---- finding 10: a link inside --weights-dir to a file elsewhere ---------------------------------


def test_a_symlink_out_of_the_weights_directory_is_refused(api_key_only):
    client, engine, tmp_path = api_key_only
    from safetensors.torch import save_file

    outside = tmp_path / "elsewhere.safetensors"
    save_file(dict(engine.runner.model.state_dict()), str(outside))
    os.symlink(outside, tmp_path / "weights" / "model.safetensors")
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "weights")}, headers=API)
    assert r.status_code == 403 and "resolves outside the weights directory" in r.text


# ---- findings 4 and 5: request ids and aborts -------------------------------------------------


def test_a_request_id_with_another_body_is_refused_with_409(api_key_only):
    client, engine, _ = api_key_only
    body = {"input_ids": [5, 6, 7], "rid": "r-1", "sampling_params": {"max_new_tokens": 3, "top_k": 5, "seed": 1}}
    first = client.post("/generate", json=body, headers=API)
    again = client.post("/generate", json=body, headers=API)
    assert first.status_code == again.status_code == 200 and first.json()["output_ids"] == again.json()["output_ids"]
    other = client.post("/generate", json={**body, "input_ids": [9, 9]}, headers=API)  # was 200 with r-1's answer
    assert other.status_code == 409 and "already names another request" in other.text
    flags = client.post("/generate", json={**body, "return_sampling_mask": True}, headers=API)  # was a 500
    assert flags.status_code == 409


def test_a_duplicates_client_going_away_leaves_the_original_running(tiny_checkpoint):
    from support_replay import SamplingParams
    from support_replay.protocol import GenerateRequest

    engine = Engine.from_pretrained(tiny_checkpoint)
    req = GenerateRequest([5, 6, 7], SamplingParams(top_k=5, seed=2), max_new_tokens=20, ignore_eos=True, rid="long")
    original = engine.submit(req)
    duplicate = engine.submit(
        GenerateRequest([5, 6, 7], SamplingParams(top_k=5, seed=2), max_new_tokens=20, ignore_eos=True, rid="long")
    )
    assert duplicate is not original
    engine.abort(duplicate)  # was: the original's future, aborted
    engine.wait([original])
    assert original.result().num_tokens == 20 and duplicate.result().output_ids == original.result().output_ids


def test_finished_answers_are_kept_within_a_byte_budget():
    from concurrent.futures import Future

    import numpy as np

    from support_replay import SamplingParams, SupportTable
    from support_replay.engine.ledger import Ledger, completion_bytes
    from support_replay.protocol import Completion, GenerateRequest

    ledger = Ledger(max_queue=10, finished_bytes=3 * 4096 * 4 + 5000)
    for i in range(5):
        req = GenerateRequest([1, 2], SamplingParams(top_k=5), rid=f"r{i}")
        f = Future()
        assert ledger.enqueue(req, f) is None
        big = Completion(
            output_ids=[1] * 4,
            finish_reason={"type": "length"},
            log_mu=np.zeros(4, np.float32),
            support=SupportTable.from_rows([np.arange(4096)] + [np.array([1])] * 3),
        )
        ledger.finished(req, f, big)
    assert completion_bytes(big) > 4096 * 4
    assert list(ledger._finished) == [
        "r2",
        "r3",
        "r4",
    ]  # was kept by count alone: 4,096 of them, ~67 MB each at full capacity


def test_an_abort_after_the_answer_leaves_nothing_behind(tiny_checkpoint):
    from support_replay import SamplingParams
    from support_replay.protocol import GenerateRequest

    engine = Engine.from_pretrained(tiny_checkpoint)
    for i in range(200):  # finished futures dropped by their callers, their addresses free for reuse
        f = engine.submit(GenerateRequest([5, 6], SamplingParams(top_k=5, seed=i), max_new_tokens=1))
        engine.wait([f])
        engine.abort(f)  # a client that went away after its answer
    assert engine.ledger._aborted == {}  # was one record per finished future, keyed by a reusable id()
    fresh = [
        engine.submit(GenerateRequest([5, 6], SamplingParams(top_k=5, seed=i), max_new_tokens=2)) for i in range(50)
    ]
    engine.wait(fresh)
    assert all(f.exception() is None for f in fresh)


# ---- finding 1: one request body became millions of engine requests ----------------------------


def test_a_body_that_fans_out_past_the_queue_is_refused_before_anything_is_built(api_key_only):
    import json

    client, engine, _ = api_key_only
    hostile = json.dumps({"prompt": [[1]] * 1_000_000, "n": 64, "max_tokens": 1}).encode()  # 5 MB: ~10^8 requests
    r = client.post("/v1/completions", content=hostile, headers={**API, "content-type": "application/json"})
    assert r.status_code == 400 and "1000000 entries exceed the limit of 4096 prompts" in r.text
    r = client.post(
        "/generate",
        content=json.dumps({"input_ids": [[1]] * 1_000_000}).encode(),
        headers={**API, "content-type": "application/json"},
    )
    assert (
        r.status_code == 400 and "exceed the limit" in r.text and len(r.text) < 2000
    )  # the first errors only, not a million
    r = client.post("/v1/completions", json={"prompt": [[1, 2]] * 300, "n": 64, "max_tokens": 1}, headers=API)
    assert r.status_code == 400 and "300 x 64 = 19200 requests exceed the engine's queue of 256" in r.text
    r = client.post("/generate", json={"input_ids": [[1, 2]] * 300}, headers=API)
    assert r.status_code == 400 and "300 x 1 = 300 requests exceed" in r.text
    assert sum(engine.stats.requests.values()) == 0  # not one request reached the engine
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": [[1, 2]] * 4, "n": 64, "max_tokens": 1}, headers=API)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


# ---- finding 7: the router and its clients -------------------------------------------------------


def _router_app(handler, engines=("http://a:1", "http://b:1")):
    import httpx

    from support_replay.serving.router import Router, create_router_app

    router = Router(list(engines))
    app = create_router_app(router, allowed_hosts=["testserver"])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router, app


def test_a_read_timeout_is_not_sent_to_every_engine_in_turn():
    import httpx

    tried = []

    def slow(request):
        tried.append(request.url.host)
        raise httpx.ReadTimeout("no answer", request=request)

    router, app = _router_app(slow)
    status, body = raw_request(app, "POST", "/generate", b'{"input_ids": [1]}')
    assert status == 504 and b"not retried elsewhere" in body and len(tried) == 1  # was tried on a, then b
    assert all(w.healthy for w in router.workers)


def test_a_dropped_connection_is_still_retried_elsewhere():
    import httpx

    tried = []

    def first_dies(request):
        tried.append(request.url.host)
        if len(tried) == 1:
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        return httpx.Response(200, json={"ok": True})

    router, app = _router_app(first_dies)
    status, _ = raw_request(app, "POST", "/generate", b'{"input_ids": [1]}')
    assert status == 200 and len(tried) == 2


def test_a_client_going_away_cancels_the_engine_request():
    import asyncio

    cancelled = []

    async def never(request):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(request.url.path)
            raise

    router, app = _router_app(never)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), (b"content-length", b"2")],
    }
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    import time

    start = time.monotonic()

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - start)))  # the client hangs up while the engine computes
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    async def main():
        await asyncio.wait_for(app(scope, receive, send), timeout=10)

    asyncio.run(main())
    assert cancelled == ["/generate"]  # was: the engine kept generating for a client that had gone
    assert router.workers[0].outstanding == router.workers[1].outstanding == 0


# ---- finding 11: /health under a burst -----------------------------------------------------------


def test_a_full_queue_answers_503_before_the_body_is_parsed(tiny_checkpoint):
    from support_replay import SamplingParams
    from support_replay.engine.limits import EngineLimits
    from support_replay.protocol import GenerateRequest

    engine = Engine.from_pretrained(
        tiny_checkpoint, EngineSettings(limits=EngineLimits(max_queue=2))
    )  # not started: nothing leaves the queue
    app = create_app(engine, allowed_hosts=["testserver"], start_engine=False)
    queued = [
        engine.submit(GenerateRequest([5, 6], SamplingParams(top_k=5, seed=i), max_new_tokens=2)) for i in range(2)
    ]
    status, body = raw_request(app, "POST", "/generate", b"{ not json at all")
    assert status == 503 and b"admission queue is full" in body  # refused without parsing (a parse would be a 400)
    assert raw_request(app, "GET", "/health", b"")[0] == 200
    engine.wait(queued)
    assert (
        raw_request(app, "POST", "/generate", b"{ not json at all")[0] == 400
    )  # room again: parsed, and refused for what it is


# ---- finding 8: sessions ---------------------------------------------------------------------------


def test_session_metadata_is_bounded_and_a_refused_merge_changes_nothing():
    from support_replay import SamplingParams
    from support_replay.errors import RequestError
    from support_replay.rollout.session import MAX_METADATA_BYTES, SessionSettings, SessionStore

    store = SessionStore(backend=None, renderer=None, settings=SessionSettings(SamplingParams(top_k=5)))
    session = store.create(metadata={"task": 1})
    store.finish(session.id, 1.0, {"a": "x" * 1000})
    for i in range(10):  # each /finish merges: was unbounded
        with pytest.raises(
            RequestError, match=f"metadata of \\d+ bytes as JSON exceeds the limit of {MAX_METADATA_BYTES}"
        ):
            store.finish(session.id, 1.0, {f"k{i}": "y" * MAX_METADATA_BYTES})
    assert set(session.metadata) == {"task", "a"}
    with pytest.raises(RequestError, match="exceeds the limit"):
        store.create(metadata={"big": "z" * (MAX_METADATA_BYTES + 1)})


def test_a_session_that_cannot_open_fails_its_episode_not_the_rollout():
    import asyncio

    from support_replay import SamplingParams
    from support_replay.rollout.agents import AgentRunner, Episode
    from support_replay.rollout.session import SessionSettings, SessionStore

    store = SessionStore(backend=None, renderer=None, settings=SessionSettings(SamplingParams(top_k=5)), max_sessions=1)
    store.create()  # the store is full
    runner = AgentRunner(type("A", (), {"style": "client"})(), store, "http://127.0.0.1:1", reward_fn=None, timeout=5)
    result = asyncio.run(
        runner.episode(Episode(0, 0, "hi", None, max_turns=1), seed=1, settings=store.settings, rollout=0)
    )
    assert result.samples == [] and "sessions: 1 are open" in str(result.error)  # was raised out of the whole rollout


def test_the_trainers_session_server_checks_host_and_key(tiny_agent_checkpoint, tmp_path):
    import httpx

    from recipe_helpers import agent_config, parts

    _, rollouts = parts(tiny_agent_checkpoint, agent_config(tiny_agent_checkpoint, tmp_path, agent="chain"))
    try:
        url = rollouts.session_server.url
        assert (
            httpx.post(url + "/sessions", json={}).status_code == 401
        )  # was 200: anyone on the machine could open sessions
        assert (
            httpx.get(url + "/health", headers={"host": "evil.example"}).status_code == 400
        )  # was 200: any Host (DNS rebinding)
        session = rollouts.sessions.create()
        r = httpx.post(
            f"{url}/sessions/{session.id}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "1+1"}], "max_tokens": 2},
        )
        assert r.status_code == 200  # a session's own URL is its key: plain-HTTP agents keep working
    finally:
        rollouts.close()


def sessions_client(tiny_checkpoint, replies, keys=None, **store_kw):
    from test_sessions import PARAMS, ScriptedBackend
    from transformers import AutoTokenizer

    from support_replay.rollout.chat import ChatRenderer, builtin_template
    from support_replay.rollout.session import SessionSettings, SessionStore
    from support_replay.serving.sessions import create_sessions_app

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    backend = ScriptedBackend(tokenizer, replies)
    settings = SessionSettings(PARAMS, max_new_tokens=16, ttl=store_kw.pop("ttl", 900.0))
    store = SessionStore(backend, ChatRenderer(tokenizer, builtin_template("hermes_tools")), settings, **store_kw)
    return store, TestClient(create_sessions_app(store, keys=keys))


HI = [{"role": "user", "content": "hi"}]


def test_refused_first_turns_hold_no_place_in_the_session_table(tiny_checkpoint):
    """Issue 55, finding 6: a session opened before its turn was checked, so refused requests with new ids filled
    the table, and every new client got a 500 until the TTL; a full table is now a 503 with Retry-After."""
    store, client = sessions_client(tiny_checkpoint, ["fine"] * 8, max_sessions=4)
    for i in range(8):
        r = client.post("/v1/chat/completions", headers={"X-Session-ID": f"bad-{i}"}, json={"messages": HI, "n": 2})
        assert r.status_code == 400 and "n=2" in r.text
        r = client.post(
            "/v1/chat/completions", headers={"X-Session-ID": f"worse-{i}"}, json={"messages": HI, "temperature": 0.3}
        )
        assert r.status_code == 400 and "rollout setting" in r.text  # refused inside the turn, after it opened
    assert len(store) == 0
    for i in range(4):
        r = client.post("/v1/chat/completions", headers={"X-Session-ID": f"good-{i}"}, json={"messages": HI})
        assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", headers={"X-Session-ID": "one-more"}, json={"messages": HI})
    assert r.status_code == 503 and r.headers["retry-after"] == "5" and "4 are open" in r.text


def test_each_api_key_has_its_own_ids_and_quota(tiny_checkpoint):
    """Issue 55, finding 5 (and 6's quota): with the shared key anyone who knew or guessed another client's
    X-Session-ID continued that conversation, its turn trained with the victim's reward, and ``meta_info`` gave
    out the internal session id. Ids now live in the namespace of the key presented; a history other than the
    conversation's own is refused (409), not split; the id a client sees is its own."""
    from support_replay.serving.security import caller_of

    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    store, client = sessions_client(
        tiny_checkpoint, ["one", "two", "three"], keys=Keys(api="key-a", callers=("key-b",)), max_sessions_per_caller=2
    )
    first = client.post(
        "/v1/chat/completions",
        headers={**a, "X-Session-ID": "trace-1"},
        json={"messages": HI, "return_meta_info": True},
    )
    assert first.status_code == 200, first.text
    meta = first.json()["choices"][0]["meta_info"]
    victim = store.clients.session_for("trace-1", caller=caller_of("Bearer key-a"))
    assert meta["session_id"] == "trace-1" and victim.id not in first.text
    foreign = [{"role": "user", "content": "ignore that"}, {"role": "assistant", "content": "ok"}, *HI]
    other = client.post("/v1/chat/completions", headers={**b, "X-Session-ID": "trace-1"}, json={"messages": foreign})
    assert other.status_code == 200 and victim.turns == 1  # key b's own trace-1, not key a's
    rewrite = client.post("/v1/chat/completions", headers={**a, "X-Session-ID": "trace-1"}, json={"messages": foreign})
    assert rewrite.status_code == 409 and "never splits" in rewrite.text
    assert victim.splits == [] and victim.turns == 1
    assert (
        client.post("/v1/chat/completions", headers={**a, "X-Session-ID": "trace-2"}, json={"messages": HI}).status_code
        == 200
    )
    over = client.post("/v1/chat/completions", headers={**a, "X-Session-ID": "trace-3"}, json={"messages": HI})
    assert over.status_code == 429 and over.headers["retry-after"] == "5" and "quota (2)" in over.text
    none = client.post("/v1/chat/completions", headers={"X-Session-ID": "trace-4"}, json={"messages": HI})
    assert none.status_code == 401


def test_an_expired_session_is_gone_at_its_next_access(tiny_checkpoint):
    """Issue 55, finding 6: expiry was only swept when a session opened; a lookup now drops an expired one."""
    import time

    from support_replay.errors import SessionNotFound

    store, _ = sessions_client(tiny_checkpoint, [], ttl=0.05)
    session = store.create()
    assert store.get(session.id) is session
    time.sleep(0.1)
    with pytest.raises(SessionNotFound):
        store.get(session.id)
    assert len(store) == 0


# ---- round three, finding 2: what one request may capture -------------------------------------------


def capture_limited(tiny_checkpoint, **limits):
    from support_replay.engine.limits import EngineLimits

    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(limits=EngineLimits(**limits))).start()
    return engine, TestClient(create_app(engine, allowed_hosts=["testserver"]))


HOSTILE_CAPTURE = {
    "prompt": "hi",
    "n": 8,
    "max_tokens": 1000,
    "ignore_eos": True,
    "temperature": 50,
    "top_k": 384,
    "return_sampling_mask": True,
    "return_meta_info": True,
    "sampling_logprobs_mode": "support",
}


def test_a_body_that_may_capture_past_the_budget_is_refused_before_it_runs(tiny_checkpoint):
    """Issue 55, finding 2: nothing bounded n x max_new_tokens x support per request; this 192-byte body got a
    66.7 MiB answer (481 MB of RSS) on the tiny model. Its worst case is counted when it is validated."""
    engine, client = capture_limited(tiny_checkpoint, max_capture_ids=1_000_000)
    try:
        r = client.post("/v1/completions", json={**HOSTILE_CAPTURE, "sampling_mask_format": "binary"})
        assert r.status_code == 400 and "may capture 3,072,000 support ids" in r.text and "1,000,000" in r.text
        assert "max_new_tokens 1000 x 384 ids per token" in r.text
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 0.9, "max_new_tokens": 300},
                                           "return_sampling_mask": True})  # fmt: skip
        assert r.status_code == 400 and "300 x 4096 ids per token" in r.text  # no top_k: the capacity bounds a row
        assert sum(engine.stats.requests.values()) == 0 and client.get("/health").status_code == 200
    finally:
        engine.shutdown()


def test_an_answer_too_large_as_json_lists_names_the_binary_form(tiny_checkpoint):
    """Issue 55, finding 2: past ``max_json_capture_bytes`` a JSON answer is a 400 naming its size and the binary
    form, never a silent switch of format; the binary form of the same body is answered."""
    engine, client = capture_limited(tiny_checkpoint, max_json_capture_bytes=64 * 1024)
    body = {**HOSTILE_CAPTURE, "n": 2, "max_tokens": 12, "seed": 1}
    try:
        r = client.post("/v1/completions", json=body)  # top_k bounds it: refused before it runs
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and '"sampling_mask_format": "binary"' in message and "MiB as JSON lists" in message
        assert "may capture 9,216 support ids (max_new_tokens x top_k)" in message and "65,536 bytes" in message
        assert sum(engine.stats.requests.values()) == 0
        binary = client.post("/v1/completions", json={**body, "sampling_mask_format": "binary"})
        assert binary.status_code == 200 and len(binary.json()["choices"]) == 2
        top_p = {k: v for k, v in body.items() if k != "top_k"} | {"top_p": 0.999}  # no bound: checked once run
        r = client.post("/v1/completions", json=top_p)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "ids) is about" in message and '"binary"' in message, message
        native = {"text": "hi", "sampling_params": {"top_k": 384, "temperature": 50, "max_new_tokens": 12,
                                                    "ignore_eos": True}, "return_sampling_mask": True,
                  "sampling_logprobs_mode": "support"}  # fmt: skip
        assert client.post("/generate", json=native).status_code == 400
        assert client.post("/generate", json={**native, "sampling_mask_format": "binary"}).status_code == 200
    finally:
        engine.shutdown()


def test_running_rows_hold_a_capture_budget_and_new_requests_wait_for_it(tiny_checkpoint):
    """Issue 55, finding 2: captured ids in flight count against ``max_capture_ids_running``; past it a new
    request waits for running rows to finish (it is not refused, and nothing is lost)."""
    from support_replay import SamplingParams
    from support_replay.engine.limits import EngineLimits
    from support_replay.protocol import GenerateRequest

    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(limits=EngineLimits(max_capture_ids_running=1)))
    request = lambda seed: GenerateRequest(  # noqa: E731
        [5, 6, 7], SamplingParams(top_k=8, seed=seed), max_new_tokens=4, ignore_eos=True, return_sampling_mask=True
    )
    first = engine.submit(request(1))
    engine.step()
    assert engine.num_running == 1 and engine.batch.captured_ids() > 1
    second = engine.submit(request(2))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1  # waits: the running row holds the budget
    while not second.done():
        engine.step()
    assert first.result().num_tokens == 4 and second.result().num_tokens == 4


# ---- round three, finding 4: text that cannot fit is refused before it is tokenized ------------------


def test_text_that_cannot_fit_the_prompt_limit_is_refused_before_tokenizing(api_key_only):
    """Issue 55, finding 4: a 7 MB chat message was rendered and tokenized on the event loop (10.2 s, /health
    waiting as long) before its 400; text longer than the prompt limit allows is now refused before any work,
    and what is tokenized is tokenized off the event loop."""
    client, engine, _ = api_key_only
    huge = "word " * 1_400_000  # 7 MB
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"prompt": huge}),
        ("/generate", {"text": huge}),
    ]:
        r = client.post(path, json=body, headers=API)
        assert r.status_code == 400 and "characters cannot fit the limit of" in r.text and "before tokenizing" in r.text
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                     headers=API)  # fmt: skip
    assert ok.status_code == 200 and sum(engine.stats.requests.values()) == 1


# ---- round three, the low findings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 1e-40, "logprobs": 1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 1e300}, "logprobs": 1}, "logit_bias"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 1e-40}}, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 1e300}}, "frequency_penalty"),
    ],
)
def test_settings_that_overflow_float32_are_a_400_not_a_plain_text_500(api_key_only, path, body, field):
    """Issue 55, low: temperature 1e-40 or a logit bias of 1e300 made the logits inf, the log-probs NaN and the
    answer a plain-text 500 (its JSON could not be written)."""
    client, _, _ = api_key_only
    r = client.post(path, json=body, headers=API)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_body_less_post_from_a_web_page_is_refused(tiny_checkpoint):
    """Issue 55, low: a POST with no body passed the JSON-only rule, so any web page could flush a keyless
    loopback engine's cache (a body-less cross-origin POST needs no preflight); browsers send ``Origin``."""
    engine = Engine.from_pretrained(tiny_checkpoint)
    client = TestClient(create_app(engine, allowed_hosts=["testserver"], start_engine=False))
    page = client.post("/flush_cache", headers={"Origin": "https://attacker.example"})
    assert page.status_code == 415, page.text
    assert client.post("/flush_cache").status_code == 200  # SGLang's clients, which send no Origin


def test_a_hop_never_sends_its_clients_key_on():
    """Issue 55, low: the router sent the key its clients present to the engines; on an engine with an API key
    alone that key is the admin key too, so every client of the router held the engine's admin key. A hop sends
    its own keys (--upstream-*-key-file), or none."""
    import httpx

    from support_replay.serving.router import Router, create_router_app

    seen = []

    def engine(request):
        seen.append((request.url.path, request.headers.get("authorization")))
        return httpx.Response(200, json={"success": True, "text": ""})

    for upstream, sent in [(None, None), (Keys(api="engine-key", admin="engine-admin"), "engine")]:
        router = Router(["http://a:1"], keys=Keys(api="api-key", admin="admin-key"), upstream=upstream)
        app = create_router_app(router, allowed_hosts=["testserver"])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        seen.clear()
        assert raw_request(app, "POST", "/generate", b'{"input_ids": [1]}', API)[0] == 200
        admin = {"Authorization": "Bearer admin-key"}
        assert raw_request(app, "POST", "/update_weight_version", b'{"new_version": "v"}', admin)[0] == 200
        expected = [None, None] if sent is None else ["Bearer engine-key", "Bearer engine-admin"]
        assert [auth for _, auth in seen] == expected  # before: "Bearer api-key" and "Bearer admin-key"


def test_every_file_of_an_adapter_or_weights_folder_must_stay_under_the_weights_directory(api_key_only):
    """Issue 55, low: only ``*.safetensors`` links were checked, so an adapter's ``adapter_config.json`` could point
    anywhere; and disk weights were read long after their path was checked (an update waits for the batch)."""
    client, engine, tmp_path = api_key_only
    from safetensors.torch import save_file

    adapter = tmp_path / "weights" / "adapter"
    adapter.mkdir(parents=True)
    secret = tmp_path / "secret.json"
    secret.write_text('{"r": 8}')
    os.symlink(secret, adapter / "adapter_config.json")
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)}, headers=API)
    assert r.status_code == 403 and "adapter_config.json resolves outside" in r.text, r.text
    # a folder checked when asked and changed before it is read: the read checks again, and nothing is loaded
    from support_replay.engine.weight_updates import CheckedPath, outside

    folder = tmp_path / "weights" / "next"
    folder.mkdir()
    assert outside(folder, tmp_path / "weights") is None  # what the route checks when asked: it passes
    elsewhere = tmp_path / "elsewhere-2.safetensors"
    save_file({k: v.clone() for k, v in engine.runner.model.state_dict().items()}, str(elsewhere))
    # the folder changes after that check and before the read: linked before the update is queued, so the engine's
    # loop cannot read the folder first (queued first, a loaded machine read it empty: "no .safetensors file")
    os.symlink(elsewhere, folder / "model.safetensors")
    update = engine.update_weights_from_disk(CheckedPath(folder, tmp_path / "weights"), "v2")
    engine.wait([update], timeout=60)
    with pytest.raises(Exception, match="model.safetensors resolves outside"):
        update.result()
    assert engine.weight_version != "v2"


def test_request_ids_are_per_key_per_weights_and_name_every_setting(tiny_checkpoint):
    """Issue 55, low: the rid fingerprint left out ``return_routed_experts``, answers kept for repeated ids outlived
    weight updates, and every client shared one rid space (one key's id answered, or 409'd, another key's)."""
    from support_replay.engine.ledger import fingerprint
    from support_replay.protocol import GenerateRequest

    plain = GenerateRequest([1, 2], rid="r")
    assert fingerprint(plain) != fingerprint(GenerateRequest([1, 2], rid="r", return_routed_experts=True))
    engine = Engine.from_pretrained(tiny_checkpoint).start()
    try:
        keys = Keys(api="key-a", callers=("key-b",))
        client = TestClient(create_app(engine, keys=keys, allowed_hosts=["testserver"]))
        body = {"text": "hi", "rid": "same", "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}
        a = client.post("/generate", json=body, headers={"Authorization": "Bearer key-a"})
        other = {**body, "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1}}
        b = client.post("/generate", json=other, headers={"Authorization": "Bearer key-b"})
        assert a.status_code == 200 and b.status_code == 200, b.text  # before: 409, "rid already names another"
        before = engine.stats.duplicates
        again = client.post("/generate", json=body, headers={"Authorization": "Bearer key-a"})
        assert again.json()["output_ids"] == a.json()["output_ids"] and engine.stats.duplicates == before + 1
        engine.wait([engine.update_weight_version("v2")], timeout=60)
        after = client.post("/generate", json=body, headers={"Authorization": "Bearer key-a"})
        assert after.json()["meta_info"]["weight_version"] == "v2"  # before: the kept answer of "default"
        assert engine.stats.duplicates == before + 1
    finally:
        engine.shutdown()


class WaitingBackend:
    """A backend whose every request waits (as one queued behind a busy engine would) until it is cancelled."""

    retries = 0

    def __init__(self, tokenizer):
        self.vocab_size = len(tokenizer)
        self.cancelled = threading.Event()
        self.ran_to_its_end = threading.Event()

    def generate(self, requests, *, return_exceptions=False):
        time.sleep(3)  # nothing can stop it
        self.ran_to_its_end.set()
        raise EngineUnavailable("completion 0: no answer (the test's backend)")

    def generate_streaming(self, request, on_token, cancelled=None):
        if cancelled is not None and cancelled.wait(30):
            self.cancelled.set()
            raise EngineUnavailable("completion 0: the client went away")
        raise EngineUnavailable("completion 0: never cancelled")


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_turn_whose_client_leaves_is_dropped_at_the_engine(tiny_checkpoint, stream):
    """Issue 55, low: a session's turn was not cancelled when its client left, non-streamed or before its first
    token: it held its engine slot to its end."""
    import httpx
    from test_sessions import PARAMS
    from transformers import AutoTokenizer

    from support_replay.rollout.chat import ChatRenderer, builtin_template
    from support_replay.rollout.session import SessionSettings, SessionStore
    from support_replay.serving.sessions import create_sessions_app
    from support_replay.serving.threaded import ThreadedServer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    backend = WaitingBackend(tokenizer)
    store = SessionStore(backend, ChatRenderer(tokenizer, builtin_template("hermes_tools")), SessionSettings(PARAMS))
    server = ThreadedServer(create_sessions_app(store)).start()
    try:
        sid = httpx.post(server.url + "/sessions").json()["session_id"]
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{server.url}/sessions/{sid}/v1/chat/completions", json={"messages": HI, "stream": stream},
                       timeout=0.5)  # fmt: skip
        assert backend.cancelled.wait(10) and not backend.ran_to_its_end.is_set()
    finally:
        server.stop()
        store.close()


def test_a_cancelled_stream_closes_its_socket_before_any_chunk_came():
    """The SGLang backend's half: setting the turn's Cancellation shuts the socket of a stream still waiting for
    its first chunk (a flag read between chunks was read only once a token came), and the server sees it go."""
    from fastapi import FastAPI, Request

    from support_replay.backends.cancellation import Cancellation
    from support_replay.backends.sglang import SGLangBackend
    from support_replay.protocol import GenerateRequest
    from support_replay.serving.threaded import ThreadedServer

    app, left = FastAPI(), threading.Event()

    @app.post("/generate")
    async def generate(request: Request):  # as a queued request's stream: headers at once, no chunk yet
        from fastapi.responses import StreamingResponse

        async def nothing_yet():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            left.set()
            yield b""

        return StreamingResponse(nothing_yet(), media_type="text/event-stream")

    server = ThreadedServer(app).start()
    try:
        backend, cancelled = SGLangBackend(server.url, 384, timeout=30), Cancellation()
        threading.Timer(0.3, cancelled.set).start()
        with pytest.raises(EngineUnavailable, match="went away"):
            backend.generate_streaming(GenerateRequest([1, 2]), lambda token: None, cancelled)
        assert left.wait(10)
    finally:
        server.stop()


def test_a_weights_upload_streams_to_disk_and_is_bounded_by_the_models_size(tiny_checkpoint, monkeypatch):
    """Issue 55, low: the weights upload read its body whole into memory, up to 64 GiB, beside its tensors."""
    from safetensors.torch import save
    from starlette.requests import Request

    engine = Engine.from_pretrained(tiny_checkpoint).start()
    try:
        client = TestClient(create_app(engine, keys=Keys(admin="root"), allowed_hosts=["testserver"]))
        admin = {"Authorization": "Bearer root", "Content-Type": "application/octet-stream"}
        params = sum(t.numel() for t in engine.runner.model.state_dict().values())
        route = "/update_weights_from_safetensors"
        r = client.post(route, content=b"\0" * (4 * params + 16 * 2**20 + 1), headers=admin)
        assert r.status_code == 413 and "in float32 with a header" in r.text  # before: read, then a 400

        def whole_body(self):
            raise AssertionError("the upload was read whole into memory")

        monkeypatch.setattr(Request, "body", whole_body)
        state = save({k: v.clone() for k, v in engine.runner.model.state_dict().items()})
        r = client.post(route, content=state, params={"weight_version": "up"}, headers=admin)
        assert r.status_code == 200 and engine.weight_version == "up", r.text
    finally:
        engine.shutdown()
