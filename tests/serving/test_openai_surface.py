"""The plain OpenAI surface of `serve`, driven by the real `openai` client as a user would:
models, completions, chat, n, streaming, logprobs (log mu) and top_logprobs (the support's ids, or the
full distribution's most likely ids with no filter),
and tools rendered or refused, never ignored."""

import math

import openai
import pytest

from support_replay.engine import Engine
from support_replay.rollout.chat import builtin_template
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer

FILTER = {"top_k": 32}  # SGLang's top_k rides in extra_body


@pytest.fixture(scope="module")
def engine(tiny_agent_checkpoint):
    e = Engine.from_pretrained(tiny_agent_checkpoint).start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    server = ThreadedServer(create_app(engine, model_name="tiny")).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def tool_client(engine):
    server = ThreadedServer(create_app(engine, model_name="tiny", chat_template=builtin_template())).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


def test_models_and_text_completions_with_n_and_logprobs(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(
        model="tiny",
        prompt="What is 12 plus 7?",
        max_tokens=6,
        n=2,
        seed=3,
        top_p=0.8,
        logprobs=2,
        extra_body={**FILTER, "return_meta_info": True},
    )
    assert len(r.choices) == 2 and r.choices[0].text != r.choices[1].text
    for c in r.choices:  # top_logprobs asked: meta_info carries log mu of every support id, row by row
        meta = c.model_extra["meta_info"]
        for lp, top, row, row_lp in zip(
            c.logprobs.token_logprobs,
            c.logprobs.top_logprobs,
            meta["output_token_sampling_mask"],
            meta["output_token_sampling_logprobs"],
        ):
            # the completions API keys top_logprobs by text: two byte tokens that decode alike ("\ufffd") share one key
            assert (
                lp in row_lp
                and 1 <= len(top) <= min(2, len(row))
                and set(top.values()) <= set(sorted(row_lp, reverse=True)[:2])
            )
    plain = client.completions.create(
        model="tiny",
        prompt="What is 12 plus 7?",
        max_tokens=6,
        seed=3,
        top_p=0.8,
        logprobs=0,
        extra_body={**FILTER, "return_meta_info": True},
    ).choices[0]
    assert (
        plain.logprobs.token_logprobs == plain.model_extra["meta_info"]["output_token_sampling_logprobs"]
    )  # log mu, as sampled
    again = client.completions.create(
        model="tiny", prompt="What is 12 plus 7?", max_tokens=6, n=2, seed=3, top_p=0.8, extra_body=FILTER
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeds seed+i: reproducible
    streamed = client.completions.create(
        model="tiny", prompt="What is 12 plus 7?", max_tokens=6, seed=3, top_p=0.8, stream=True, extra_body=FILTER
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == r.choices[0].text


def test_chat_streaming_n_and_top_logprobs(client):
    messages = [{"role": "user", "content": "Count to five."}]
    whole = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        seed=1,
        top_p=0.9,
        n=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={**FILTER, "return_meta_info": True},
    )
    assert len(whole.choices) == 3 and whole.usage.completion_tokens == sum(
        len(c.model_extra["meta_info"]["output_ids"]) for c in whole.choices
    )
    first = whole.choices[0]
    meta = first.model_extra["meta_info"]
    for entry, row, lp in zip(
        first.logprobs.content, meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    ):
        assert entry.logprob in lp and len(entry.top_logprobs) == min(
            3, len(row)
        )  # lp: log mu of every id of the support
        assert [t.logprob for t in entry.top_logprobs] == sorted(lp, reverse=True)[:3]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        seed=1,
        top_p=0.9,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=FILTER,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.message.content
    assert chunks[-1].usage.completion_tokens == len(meta["output_ids"])
    # no filter: the full distribution's most likely ids, the sampled token's full-vocabulary log-prob among them
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, seed=2, logprobs=True, top_logprobs=5
    ).choices[0]
    for entry in plain.logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.logprob <= values[0] and (entry.logprob < values[-1] or entry.logprob in values)
        assert 0.0 < sum(math.exp(v) for v in values) <= 1.0 + 1e-5


def test_tools_are_rendered_or_refused_never_ignored(client, tool_client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    with pytest.raises(openai.BadRequestError, match="cannot render tools"):
        client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=4)
    r = tool_client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=4, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="tool_choice: function 'clock' is not among"):
        tool_client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "clock"}},
            max_tokens=4,
        )
    with pytest.raises(openai.BadRequestError, match=r"repetition_penalty: must be in \(0, 2\]"):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body={"repetition_penalty": -1}
        )
