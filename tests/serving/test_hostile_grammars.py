"""Issue 55, finding 3: grammars were compiled per request, twice (validated on the event loop, built again on
the engine's thread at admission), uncached: a 390 KB JSON schema with ``n: 16`` held every client for 11 s.
Each test here is the probe that answered wrongly before the fix (docs/reliability.md, round three)."""

import json
import threading

import httpx
import llguidance
import pytest
from fastapi.testclient import TestClient

from support_replay.engine import Engine, EngineSettings
from support_replay.engine.limits import EngineLimits
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer

# the module's engine starts its grammar compiler's process on the first grammar, whichever test sends it
pytestmark = pytest.mark.processes

SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def wide_schema(pairs: int) -> dict:
    """The probe's schema: an ``anyOf`` of ``pairs`` ``allOf`` pairs of 30-property objects (200: 390 KB)."""

    def obj(i, j):
        props = {f"p{i}_{j}_{k}": {"type": "string"} for k in range(30)}
        return {"type": "object", "properties": props, "required": [f"p{i}_{j}_0"]}

    return {"anyOf": [{"allOf": [obj(i, 0), obj(i, 1)]} for i in range(pairs)]}


def constrained(schema: dict, **body) -> dict:
    form = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_k": 20, "response_format": form,
            **body}  # fmt: skip


class CountingMatcher:
    """Stands in for ``llguidance.LLMatcher`` in this process: counts the matchers built and grammars validated
    here (the worker process imports its own), and can hold a build until the test lets it go."""

    real = llguidance.LLMatcher
    built = validated = 0
    entered = threading.Event()
    release = threading.Event()

    def __new__(cls, *args, **kwargs):
        cls.built += 1
        cls.entered.set()
        cls.release.wait(30)
        return cls.real(*args, **kwargs)

    @classmethod
    def validate_grammar(cls, *args, **kwargs):
        cls.validated += 1
        cls.entered.set()
        cls.release.wait(30)
        return cls.real.validate_grammar(*args, **kwargs)

    grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
    grammar_from_regex = staticmethod(real.grammar_from_regex)
    grammar_from_lark = staticmethod(real.grammar_from_lark)


@pytest.fixture
def counting(monkeypatch):
    CountingMatcher.built = CountingMatcher.validated = 0
    CountingMatcher.entered.clear()
    CountingMatcher.release.set()
    monkeypatch.setattr(llguidance, "LLMatcher", CountingMatcher)
    yield CountingMatcher
    CountingMatcher.release.set()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint).start()
    yield engine
    engine.shutdown()


def test_a_grammar_is_compiled_once_however_many_requests_carry_it(engine, counting):
    client = TestClient(create_app(engine, allowed_hosts=["testserver"]))
    schema = wide_schema(3)
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=constrained(schema, n=16))
        assert r.status_code == 200, r.text
    # before: 32 in this process per body (16 validated on the event loop, 16 built at admission)
    assert (counting.built, counting.validated) == (1, 0)


def test_the_server_answers_while_a_grammar_compiles(engine, counting):
    server = ThreadedServer(create_app(engine)).start()
    try:
        counting.release.clear()  # the build in this process waits until the test has asked /health
        body = constrained(wide_schema(4))
        answer = {}
        sender = threading.Thread(
            target=lambda: answer.update(r=httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
        )
        sender.start()
        assert counting.entered.wait(30)
        health = httpx.get(server.url + "/health", timeout=10)  # before: the event loop was the compiler's
        assert health.status_code == 200
        counting.release.set()
        sender.join(60)
        assert answer["r"].status_code == 200, answer["r"].text
    finally:
        counting.release.set()
        server.stop()


def test_a_compile_past_its_deadline_is_stopped_in_its_own_process(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(limits=EngineLimits(grammar_compile_ms=50))).start()
    try:
        client = TestClient(create_app(engine, allowed_hosts=["testserver"]))
        r = client.post("/v1/chat/completions", json=constrained(wide_schema(200)))  # about 0.5 s to compile
        assert r.status_code == 400 and "grammar_compile_ms" in r.text, r.text
        assert engine.grammars.checker.killed == 1 and sum(engine.stats.requests.values()) == 0
        ok = client.post("/v1/chat/completions", json=constrained(SMALL))  # a new compiler process
        assert ok.status_code == 200, ok.text
    finally:
        engine.shutdown()


def test_a_grammar_error_is_one_line(engine):
    client = TestClient(create_app(engine, allowed_hosts=["testserver"]))
    lark = 'start: foo\nfoo: "a" | bar\n'  # llguidance's error quotes the grammar over four lines
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "top_k": 20, "structured_outputs": {"grammar": lark}},
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "unknown name" in message and "\n" not in message, message


def test_a_body_carries_at_most_max_grammar_requests_constrained_requests(engine):
    """/generate broadcast one schema to each of up to 256 prompts."""
    client = TestClient(create_app(engine, allowed_hosts=["testserver"]))
    params = {"json_schema": json.dumps(SMALL), "max_new_tokens": 2, "top_k": 20}
    many, before = 65, sum(engine.stats.requests.values())  # one past the default limit of 64
    r = client.post("/generate", json={"text": ["x"] * many, "sampling_params": params})
    assert r.status_code == 400 and "grammar-constrained requests in one body exceed" in r.text, r.text[:300]
    assert sum(engine.stats.requests.values()) == before
    assert client.post("/generate", json={"text": ["x"] * 2, "sampling_params": params}).status_code == 200
