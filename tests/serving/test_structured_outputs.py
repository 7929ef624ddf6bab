"""Structured outputs under replay: response_format, forced tool calls, vLLM's structured_outputs and
SGLang's json_schema/regex by llguidance's mask before the filters. Every JSON answer validates
against its schema (jsonschema, an independent validator); the captured supports hold allowed ids
only, and a fresh forward scored on them gives log mu; what cannot be captured is refused by name."""

import json
import re

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import support_logprobs
from support_replay.core.support import SupportTable
from support_replay.engine import Engine
from support_replay.rollout.chat import ChatRenderer, builtin_template
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer

# the module's engine starts its grammar compiler's process on the first grammar, whichever test sends it
pytestmark = pytest.mark.processes

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["cm", "kg", "s"]},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "unit", "ok", "note"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 8}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(scope="module")
def served(tiny_agent_checkpoint):
    engine = Engine.from_pretrained(tiny_agent_checkpoint).start()
    server = ThreadedServer(
        create_app(engine, model_name="tiny", chat_template=builtin_template("hermes_tools"))
    ).start()
    yield engine, server.url
    server.stop()
    engine.shutdown()


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go."}], **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_every_json_answer_validates_and_its_supports_replay(served, tiny_agent_checkpoint):
    engine, url = served
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_checkpoint, dtype=torch.float32).eval()
    response_format = {"type": "json_schema", "json_schema": {"name": "measure", "schema": SCHEMA}}
    for seed in range(8):
        choice = chat(
            url,
            response_format=response_format,
            max_tokens=96,
            seed=seed,
            top_k=20,
            logprobs=True,
            return_meta_info=True,
        )
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"
        meta = choice["meta_info"]
        support = SupportTable.from_lists(meta["output_token_sampling_mask"])
        assert max(support.sizes()) <= 20
    # the last answer: a fresh forward scored on the captured support (the trainer's score) is log mu
    renderer = ChatRenderer(engine.tokenizer, builtin_template("hermes_tools"))
    ids = renderer.encode(renderer.render([{"role": "user", "content": "Go."}], None, generation_prompt=True))
    out = meta["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()
    again = support_logprobs(logits[len(ids) - 1 : len(ids) - 1 + len(out)], torch.tensor(out), support, 1.0)
    np.testing.assert_allclose(again.numpy(), meta["output_token_sampling_logprobs"], atol=1e-4)


def test_forced_tool_calls_parse_as_calls(served):
    _, url = served
    for seed, choice_of in enumerate(["required", {"type": "function", "function": {"name": "calculator"}}] * 2):
        choice = chat(url, tools=TOOLS, tool_choice=choice_of, max_tokens=200, seed=seed, top_k=20)
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("calculator", "clock")
        if isinstance(choice_of, dict):
            assert call["function"]["name"] == "calculator"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]),
            TOOLS[0 if call["function"]["name"] == "calculator" else 1]["function"]["parameters"],
        )


def test_vllm_and_sglang_constraints(served):
    _, url = served
    for seed in range(3):
        r = httpx.post(
            url + "/inference/v1/generate",
            json={
                "token_ids": [5, 6, 7],
                "output_mode": "text",
                "sampling_params": {
                    "max_tokens": 12,
                    "seed": seed,
                    "top_k": 16,
                    "structured_outputs": {"regex": "[a-c]{2,5}"},
                },
            },
        )
        assert r.status_code == 200, r.text
        assert re.fullmatch("[a-c]{2,5}", r.json()["choices"][0]["text"])
        picked = httpx.post(
            url + "/v1/completions",
            json={"prompt": "Pick:", "max_tokens": 8, "seed": seed, "structured_outputs": {"choice": ["yes", "no"]}},
        ).json()["choices"][0]["text"]
        assert picked in ("yes", "no")
        sglang = httpx.post(
            url + "/generate",
            json={
                "text": "x",
                "sampling_params": {"max_new_tokens": 160, "sampling_seed": seed, "json_schema": json.dumps(SCHEMA)},
            },
        ).json()
        jsonschema.validate(json.loads(sglang["text"]), SCHEMA)


@pytest.mark.parametrize(
    "body, why",
    [
        ({"response_format": {"type": "json_object"}, "top_p": 0.9, "logprobs": True}, "needs a top_k in [1, "),
        ({"response_format": {"type": "json_object"}, "logprobs": True}, "grammar-masked distribution"),
        ({"response_format": {"type": "yaml"}}, "response_format.type='yaml'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope' is not among"),
        ({"tool_choice": "required"}, "has no tools to call"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos=True: a grammar ends"),
    ],
)
def test_what_cannot_be_replayed_or_compiled_is_refused_by_name(served, body, why):
    _, url = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
