"""Sessions: token-in/token-out trajectories, history rewrites, template checks, tool calls, the
episode bounds, and the HTTP endpoint driven by the real ``openai`` client. A scripted backend
answers with chosen text where the test needs a particular model output; the tiny engine
where it needs a real one."""

import asyncio
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from support_replay.core.sampling import SamplingParams
from support_replay.core.support import SupportTable
from support_replay.errors import EngineUnavailable, HistoryMismatch, RequestError, SessionBusy, SessionFailed
from support_replay.protocol import Completion, single_version
from support_replay.rollout.chat import ChatRenderer, builtin_template, normalize_message, parse_tool_calls
from support_replay.rollout.session import ChatTurn, SessionSettings, SessionStore

PARAMS = SamplingParams(temperature=1.0, top_k=32, top_p=0.8)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


class ScriptedBackend:
    """Answers each request with the next scripted text, its stop token appended; every
    sampled token gets the support {token, token+1 or token-1} and log mu log(1/2)."""

    retries = 0

    def __init__(self, tokenizer, replies, fail_at: int | None = None):
        self.tokenizer, self.replies, self.fail_at = tokenizer, list(replies), fail_at
        self.vocab_size = len(tokenizer)
        self.requests = []

    def generate(self, requests, *, return_exceptions=False):
        req = requests[0]
        self.requests.append(req)
        if self.fail_at is not None and len(self.requests) - 1 == self.fail_at:
            raise EngineUnavailable("completion 0: connection refused (scripted)")
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[: req.max_new_tokens]
        stopped = ids[-1] == self.tokenizer.eos_token_id
        rows = [np.array(sorted({t, t + 1 if t + 1 < self.vocab_size else t - 1}), np.int32) for t in ids]
        return [
            Completion(
                output_ids=ids,
                finish_reason={"type": "stop", "matched": ids[-1]}
                if stopped
                else {"type": "length", "length": len(ids)},
                log_mu=np.full(len(ids), np.log(0.5), np.float32) if req.return_sampling_mask else None,
                support=SupportTable.from_rows(rows) if req.return_sampling_mask else None,
                weight_versions=single_version("7", len(ids)),
            )
        ]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def store_of(tokenizer, replies, template="hermes_tools", **settings):
    renderer = ChatRenderer(tokenizer, builtin_template(template) if template else None)
    backend = ScriptedBackend(tokenizer, replies, settings.pop("fail_at", None))
    return SessionStore(backend, renderer, SessionSettings(PARAMS, max_new_tokens=256, **settings)), backend


def chat(store, sid, messages, **kw):
    return asyncio.run(store.chat(sid, ChatTurn(messages=messages, **kw)))


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def tool_episode(store):
    s = store.create(seed=3)
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    first = chat(store, s.id, messages, tools=TOOLS)
    messages += [
        {"role": "assistant", "content": first.content, "tool_calls": first.tool_calls},
        {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": '{"result": 42}'},
    ]
    second = chat(store, s.id, messages, tools=TOOLS)
    messages.append({"role": "assistant", "content": second.content})
    return s, messages, first, second


def test_a_tool_episode_is_recorded_token_in_token_out(tokenizer):
    store, backend = store_of(tokenizer, ["Let me compute.\n" + CALL, "It is 42."])
    s, messages, first, second = tool_episode(store)
    assert first.finish_reason == "tool_calls" and first.content == "Let me compute."
    assert json.loads(first.tool_calls[0]["function"]["arguments"]) == {"expression": "6 * 7"}
    assert second.finish_reason == "stop" and second.content == "It is 42."
    # the second request is the first one's ids, the model's output, then only the new text's ids
    r0, r1 = backend.requests
    out0 = tokenizer(first.content + "\n" + CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert r1.input_ids[: len(r0.input_ids) + len(out0)] == r0.input_ids + out0
    [sample] = s.to_samples(first_index=0, group=0, reward=1.0)
    renderer = store.renderer
    whole = renderer.render(messages, TOOLS, generation_prompt=False)
    assert whole.startswith(
        renderer.decode(sample.prompt_ids + sample.response_ids)
    )  # the template's text, up to the glue after the last turn
    mask = sample.loss_mask.astype(bool)
    assert mask.sum() == len(out0) + second.completion.num_tokens and not mask[len(out0)]
    inserted = ~mask
    assert np.all(sample.log_mu[inserted] == 0) and np.all(sample.support.sizes()[inserted] == 1)
    assert np.all(
        sample.support.ids[sample.support.offsets[:-1][inserted]] == np.asarray(sample.response_ids)[inserted]
    )
    assert np.all(sample.log_mu[mask] == np.float32(np.log(0.5))) and np.all(sample.support.sizes()[mask] == 2)
    text = renderer.decode(np.asarray(sample.response_ids)[inserted].tolist())
    assert "<tool_response>" in text and '{"result": 42}' in text and "<|im_start|>assistant" in text
    assert [(v.version, v.start, v.end) for v in sample.weight_versions] == [("7", 0, sample.response_length)]


def test_the_openai_clients_extra_null_fields_are_not_an_edit(tokenizer):
    store, _ = store_of(tokenizer, ["Let me compute.\n" + CALL, "42"])
    s = store.create()
    messages = [{"role": "user", "content": "6 * 7?"}]
    first = chat(store, s.id, messages, tools=TOOLS)
    echoed = {
        "role": "assistant",
        "content": first.content,
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": None,
        "tool_calls": [{**c, "function": dict(c["function"])} for c in first.tool_calls],
    }
    chat(store, s.id, messages + [echoed, {"role": "tool", "tool_call_id": "x", "content": "42"}], tools=TOOLS)
    assert s.splits == [] and len(s.trajectories()) == 1


@pytest.mark.parametrize("policy", ["split", "reject"])
def test_an_edited_earlier_turn_splits_or_is_rejected(tokenizer, policy):
    store, backend = store_of(tokenizer, ["Seven.", "Ten.", "Twelve."], template=None, history_policy=policy)
    s = store.create()
    m = [{"role": "user", "content": "3 + 4?"}]
    a = chat(store, s.id, m)
    m += [{"role": "assistant", "content": a.content}, {"role": "user", "content": "Add 3."}]
    b = chat(store, s.id, m)
    edited = [
        m[0],
        {"role": "assistant", "content": "7"},
        m[2],
        {"role": "assistant", "content": b.content},
        {"role": "user", "content": "Add 2."},
    ]
    if policy == "reject":
        with pytest.raises(HistoryMismatch, match=r"turn 2: history check: messages\[1\] \(assistant\) differs"):
            chat(store, s.id, edited)
        assert s.turns == 2 and len(backend.requests) == 2 and len(s.trajectories()) == 1  # nothing changed
        return
    c = chat(store, s.id, edited)
    assert c.split.startswith("turn 2: history check: messages[1] (assistant) differs")
    first, second = s.to_samples(first_index=0, group=0, reward=0.5, episode=0)
    assert first.metadata["segment"] == 0 and second.metadata["segment"] == 1 and first.reward == second.reward == 0.5
    assert store.renderer.decode(second.prompt_ids) == store.renderer.render(edited, None, generation_prompt=True)
    assert second.loss_mask.all() and s.splits[0]["turn"] == 2


REASONING_TEMPLATE = (  # drops the reasoning of assistant turns before the last user turn, as Qwen3's does
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 "
    "%}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ "
    "m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_detected(tokenizer):
    renderer = ChatRenderer(tokenizer, REASONING_TEMPLATE)
    store = SessionStore(
        ScriptedBackend(tokenizer, ["<think>3+4</think>7", "10"]),
        renderer,
        SessionSettings(PARAMS, history_policy="reject"),
    )
    s = store.create()
    m = [{"role": "user", "content": "3 + 4?"}]
    a = chat(store, s.id, m)
    with pytest.raises(HistoryMismatch, match="renders the recorded turns differently once the new messages are added"):
        chat(store, s.id, m + [{"role": "assistant", "content": a.content}, {"role": "user", "content": "Add 3."}])


def test_a_template_that_renders_a_model_turn_differently_is_detected(tokenizer):
    trimming = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    store = SessionStore(
        ScriptedBackend(tokenizer, ["  7  ", "10"]),
        ChatRenderer(tokenizer, trimming),
        SessionSettings(PARAMS, history_policy="split"),
    )
    s = store.create()
    m = [{"role": "user", "content": "3 + 4?"}]
    a = chat(store, s.id, m)
    b = chat(store, s.id, m + [{"role": "assistant", "content": a.content}, {"role": "user", "content": "Add 3."}])
    assert "renders a recorded turn differently from the tokens the model generated" in b.split
    assert len(s.trajectories()) == 2  # not silently trained as one sequence


def test_parse_tool_calls_keeps_what_does_not_parse_as_content():
    content, calls = parse_tool_calls("ok\n" + CALL + "\n" + CALL.replace("6 * 7", "1 + 1"))
    assert content == "ok" and [json.loads(c["function"]["arguments"])["expression"] for c in calls] == [
        "6 * 7",
        "1 + 1",
    ]
    for text in [
        "<tool_call>{not json}</tool_call>",
        CALL + " trailing words",
        '<tool_call>{"arguments": {}}</tool_call>',
        "plain",
    ]:
        assert parse_tool_calls(text) == (text, [])


def test_requests_that_a_session_cannot_honour_are_refused(tokenizer):
    store, _ = store_of(tokenizer, ["x"])
    s = store.create()
    m = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"temperature=0.7 differs from the run's rollout setting 1.0"):
        chat(store, s.id, m, sampling={"temperature": 0.7})
    plain, _ = store_of(tokenizer, ["x"], template=None)
    with pytest.raises(RequestError, match="cannot render tools; start with --chat-template hermes_tools"):
        chat(plain, plain.create().id, m, tools=TOOLS)
    with pytest.raises(RequestError, match=r"messages\[0\]: a message needs a role"):
        chat(store, s.id, [{"role": "wizard", "content": "x"}])
    chat(store, s.id, m, sampling={"temperature": 1.0, "top_k": 32})  # equal to the run's: accepted


def test_turn_and_token_budgets_end_the_episode_with_a_valid_trajectory(tokenizer):
    store, backend = store_of(tokenizer, ["one", "two", "three"], template=None, max_turns=2)
    s = store.create()
    m = [{"role": "user", "content": "count"}]
    for k in range(3):
        r = chat(store, s.id, m)
        m = m + [{"role": "assistant", "content": r.content}, {"role": "user", "content": "more"}]
    assert r.finish_reason == "length" and r.content == "" and r.completion is None
    assert s.turns == 2 and len(backend.requests) == 2
    [sample] = s.to_samples(first_index=0, group=0, reward=0.0)
    assert sample.loss_mask[-1] == 1  # the trajectory ends on a model token, nothing dangling inserted
    tight, backend = store_of(
        tokenizer, ["a long answer that runs past the budget"], template=None, max_episode_tokens=5
    )
    r = chat(tight, tight.create().id, m[:1])
    assert backend.requests[0].max_new_tokens == 5 and r.finish_reason == "length"


def test_a_repeated_turn_is_answered_once_and_a_failed_engine_ends_the_episode(tokenizer):
    store, backend = store_of(tokenizer, ["7", "10"], template=None, fail_at=1)
    s = store.create()
    m = [{"role": "user", "content": "3 + 4?"}]
    a = chat(store, s.id, m)
    assert chat(store, s.id, m) is a and len(backend.requests) == 1  # a client retry: same answer, nothing appended
    with pytest.raises(SessionFailed, match="turn 1: the engine failed the turn; the episode ends"):
        chat(store, s.id, m + [{"role": "assistant", "content": a.content}, {"role": "user", "content": "Add 3."}])
    with pytest.raises(RequestError, match="the session is failed"):
        chat(store, s.id, m)


def test_one_turn_at_a_time(tokenizer):
    store, _ = store_of(tokenizer, ["x", "y"], template=None)
    s = store.create()
    s._busy = True
    with pytest.raises(SessionBusy):
        chat(store, s.id, [{"role": "user", "content": "hi"}])


def test_normalize_message_joins_text_parts_and_refuses_images():
    assert normalize_message(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, 0
    ) == {"role": "user", "content": "ab"}
    with pytest.raises(RequestError, match=r"messages\[2\]: only text content parts"):
        normalize_message({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, 2)
