"""The plain OpenAI surface of the engine server: ``/v1/chat/completions`` and ``/v1/completions``,
with ``n``, ``stream``, ``logprobs``/``top_logprobs`` and tools (docs/agents.md).

``logprobs`` are log mu: the log-prob of each sampled token under the policy that sampled it,
normalised over its support (with no top-k/top-p/min-p filter that is the full-vocabulary
value). ``top_logprobs`` lists at most the ids of that support, or with no filter the most likely
ids of the full distribution after temperature. Tools are
rendered by the chat template, or refused when the template cannot render them; tool calls in
the output are parsed in the Hermes format. Streams leave token by token as the engine samples
(``openai_streaming.py``); with tool calls to parse they leave once the answer is whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import RequestError
from ..protocol import Completion
from ..rollout.chat import ChatRenderer, normalize_message, parse_tool_calls, parses_tool_calls
from .openai_format import (
    chat_choice,
    chat_response,
    chat_stream,
    new_id,
    openai_finish,
    text_choice,
    text_stream,
    token_logprobs,
)
from .openai_streaming import live_sse
from .request_fields import check_undeclared
from .schemas import SamplingParamsIn, TextBatch, TokenBatch, TokenIds, bounded_batches, check_fan_out
from .sglang_format import ResponseForm
from .structured_outputs import response_format_grammar, tool_choice_grammar, vllm_grammar

MAX_N = 64


class OpenAIIn(BaseModel):
    """Fields both OpenAI endpoints share, plus vLLM's and SGLang's sampling extras and our replay fields;
    any other field goes by ``request_fields`` (a no-op, taken at its default, or refused by name)."""

    model_config = ConfigDict(extra="allow")
    route: ClassVar[str] = "/v1/completions"

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    response_format: dict | None = None  # structured outputs (serving/structured_outputs.py)
    structured_outputs: dict | None = None  # vLLM's
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    return_sampling_mask: bool = False
    return_meta_info: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    sampling_mask_format: Literal["lists", "binary"] = "lists"
    # vLLM's OpenAI endpoints return routed experts; ours do not yet (SGLang's /generate does): refused, not ignored
    return_routed_experts: Literal[False] = Field(
        False, description="routed experts come from /generate (meta_info.routed_experts) only"
    )

    @model_validator(mode="after")
    def _declared_fields(self):
        check_undeclared(self.model_extra, self.route)
        return self

    def sampling(self, max_tokens: int | None, default_max: int) -> SamplingParamsIn:
        return SamplingParamsIn(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_new_tokens=max_tokens or default_max,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.include_stop_str_in_output or self.no_stop_trim,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
        )

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def grammar(self) -> str | None:
        """The one structured-output constraint the body asks for (response_format, a forced tool call, vLLM's
        structured_outputs), or None."""
        grammars = {
            "response_format": response_format_grammar(self.response_format),
            "tool_choice": tool_choice_grammar(getattr(self, "tool_choice", None), getattr(self, "tools", None)),
            "structured_outputs": vllm_grammar(self.structured_outputs),
        }
        given = {k: g for k, g in grammars.items() if g is not None}
        if len(given) > 1:
            raise RequestError(f"{sorted(given)}: give one structured-output constraint per request")
        return next(iter(given.values()), None)


class ChatIn(OpenAIIn):
    route: ClassVar[str] = "/v1/chat/completions"
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionIn(OpenAIIn):
    prompt: str | TextBatch | TokenIds | TokenBatch
    _bounded = model_validator(mode="before")(classmethod(lambda cls, data: bounded_batches(data, ("prompt",))))
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def requests_for(body: OpenAIIn, prompt_ids: list[int], sp: SamplingParamsIn, *, log_mu: bool, top: int) -> list:
    """``n`` requests for one prompt (seeds ``seed + i`` when a seed is given)."""
    return sp.n_requests(
        prompt_ids,
        body.n,
        top_logprobs=0 if body.filtered else top,  # unfiltered: the full distribution's most likely ids
        grammar=body.grammar(),
        return_sampling_mask=body.return_sampling_mask or (log_mu and body.filtered),
        return_logprob=log_mu and not body.filtered,
        sampling_logprobs_mode="support" if top else body.sampling_logprobs_mode,
    )


def as_log_mu(c: Completion) -> Completion:
    """With no filter the support is the vocabulary and log mu the full-vocabulary log-prob."""
    if c.log_mu is None and c.full_logprobs is not None:
        return dataclasses.replace(
            c, log_mu=c.full_logprobs
        )  # a copy: the engine may keep the answer for a repeated rid
    return c


class OpenAIHandlers:
    """The two endpoints over ``run(requests, http_request)`` (submit and wait) and ``meta_info(completion,
    request, sampling_mask_format)`` (SGLang's replay metadata); ``max_requests`` is the most engine
    requests one body may become (the engine's queue)."""

    def __init__(self, run, meta_info, model_name: str, renderer: ChatRenderer, max_requests: int, live=None):
        self.run, self.meta_info, self.model_name = run, meta_info, model_name
        self.renderer, self.max_requests = renderer, max_requests
        self.live = live  # EngineCalls (token_stream, incremental_text): streams leave as tokens are sampled

    async def _live(self, reqs):
        """A live token stream of ``reqs``, or None where there is no engine to stream from; a request the
        engine refuses at once raises here, before any chunk (a plain 4xx)."""
        if self.live is None:
            return None
        await self.live.prepare(reqs)  # grammars compiled off the event loop before they are submitted
        stream = self.live.token_stream(reqs)
        refused = stream.refused()
        if refused is not None:
            stream.abort()
            raise refused
        return stream

    async def chat(self, request: Request, body: ChatIn):
        renderer = self.renderer
        messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
        # rendering and tokenizing off the event loop (a long text no longer holds /health and every other client)
        ids = await asyncio.to_thread(lambda: renderer.encode(renderer.render(messages, body.tools, True)))
        top = body.top_logprobs or 0
        sp = body.sampling(body.max_completion_tokens or body.max_tokens, 256)
        reqs = requests_for(body, ids, sp, log_mu=body.logprobs or bool(top), top=top)
        parse = body.tools and parses_tool_calls(body.tool_choice)
        self._check_json_bound(body, reqs)
        stream = await self._live(reqs) if body.stream and not parse else None  # tool calls parse from the whole text
        if stream is not None:
            return self._chat_live(stream, body, reqs, len(ids), top)
        results = [as_log_mu(c) for c in await self.run(reqs, request)]
        self._check_json(body, reqs, results)
        choices = [self._chat_choice(i, body, req, c, top) for i, (req, c) in enumerate(zip(reqs, results))]
        completion_tokens = sum(c.num_tokens for c in results)
        model = body.model or self.model_name
        response = chat_response(choices, model=model, prompt_tokens=len(ids), completion_tokens=completion_tokens)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(chat_stream(response, usage), media_type="text/event-stream")
        return response

    def _chat_live(self, stream, body: ChatIn, reqs, prompt_tokens: int, top: int) -> StreamingResponse:
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time())}
        head["model"] = body.model or self.model_name

        def chunk(i: int, delta: dict, finish=None, logprobs=None) -> dict:
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

        def ending(i: int, c: Completion, text) -> list[dict]:
            choice = self._chat_choice(i, body, reqs[i], as_log_mu(c), top)
            rest = text.finish(choice["message"]["content"] or "")
            out = [chunk(i, {"content": rest}, logprobs=choice["logprobs"])] if rest or choice["logprobs"] else []
            last = chunk(i, {}, choice["finish_reason"])
            if "meta_info" in choice:
                last["choices"][0]["meta_info"] = choice["meta_info"]
            return out + [last]

        def usage(done: dict) -> dict | None:
            if not (body.stream_options or {}).get("include_usage"):
                return None
            completion = sum(c.num_tokens for c in done.values())
            counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
            return {**head, "choices": [], "usage": {**counts, "total_tokens": prompt_tokens + completion}}

        lines = live_sse(
            stream,
            [self.live.incremental_text(r) for r in reqs],
            opening=[chunk(i, {"role": "assistant", "content": ""}) for i in range(len(reqs))],
            delta=lambda i, text: chunk(i, {"content": text}),
            ending=ending,
            usage=usage,
        )
        return StreamingResponse(lines, media_type="text/event-stream")

    def _chat_choice(self, i: int, body: ChatIn, req, c: Completion, top: int) -> dict:
        parse = body.tools and parses_tool_calls(body.tool_choice)
        content, calls = parse_tool_calls(c.text) if parse else (c.text, [])
        finish = "tool_calls" if calls else openai_finish(c)
        logprobs = token_logprobs(c, self.renderer.decode, top) if (body.logprobs or top) else None
        meta = self._meta(body, req, c) if body.return_meta_info else None
        return chat_choice(i, content, calls, finish, logprobs, meta)

    def _completions_live(self, stream, body: CompletionIn, reqs) -> StreamingResponse:
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time())}
        head["model"] = body.model or self.model_name

        def chunk(i: int, text: str, finish=None, logprobs=None) -> dict:
            return {**head, "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

        def ending(i: int, c: Completion, text) -> list[dict]:
            c = as_log_mu(c)
            choice = text_choice(i, c.text, openai_finish(c), c, self.renderer.decode, body.logprobs)
            if body.return_meta_info:
                choice["meta_info"] = self._meta(body, reqs[i], c)
            rest = text.finish(c.text)
            out = [chunk(i, rest, logprobs=choice["logprobs"])] if rest or choice["logprobs"] else []
            last = chunk(i, "", choice["finish_reason"])
            if "meta_info" in choice:
                last["choices"][0]["meta_info"] = choice["meta_info"]
            return out + [last]

        lines = live_sse(
            stream,
            [self.live.incremental_text(r) for r in reqs],
            opening=[],
            delta=lambda i, text: chunk(i, text),
            ending=ending,
            usage=lambda done: None,
        )
        return StreamingResponse(lines, media_type="text/event-stream")

    def _check_json_bound(self, body, reqs) -> None:
        """Before the body runs: its top-k bounded capture against the JSON limit (``EngineCalls.check_json_bound``)."""
        if body.return_meta_info and self.live is not None:
            self.live.check_json_bound(reqs, ResponseForm(body.sampling_mask_format))

    def _check_json(self, body, reqs, results) -> None:
        """The whole body's capture against the JSON limit (``EngineCalls.check_json``), before any is built."""
        if body.return_meta_info and self.live is not None:
            self.live.check_json(reqs, results, ResponseForm(body.sampling_mask_format))

    def _meta(self, body, req, c: Completion) -> dict:
        return {"output_ids": c.output_ids, **self.meta_info(c, req, ResponseForm(body.sampling_mask_format))}

    async def completions(self, request: Request, body: CompletionIn):
        if body.echo or body.suffix or (body.best_of not in (None, body.n)):
            raise RequestError("echo, suffix and best_of are not supported")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt: empty")
        check_fan_out(len(prompts), body.n, self.max_requests)
        encode = self.renderer.encode
        ids = await asyncio.to_thread(lambda: [encode(p) if isinstance(p, str) else list(p) for p in prompts])
        top = body.logprobs or 0
        sp = body.sampling(body.max_tokens, 16)  # OpenAI's default max_tokens for completions
        reqs = [r for p in ids for r in requests_for(body, p, sp, log_mu=body.logprobs is not None, top=top)]
        self._check_json_bound(body, reqs)
        stream = await self._live(reqs) if body.stream else None
        if stream is not None:
            return self._completions_live(stream, body, reqs)
        results = [as_log_mu(c) for c in await self.run(reqs, request)]
        self._check_json(body, reqs, results)
        choices = []
        for i, (req, c) in enumerate(zip(reqs, results)):
            choice = text_choice(i, c.text, openai_finish(c), c, self.renderer.decode, body.logprobs)
            if body.return_meta_info:
                choice["meta_info"] = self._meta(body, req, c)
            choices.append(choice)
        usage = dict(prompt_tokens=sum(len(p) for p in ids), completion_tokens=sum(c.num_tokens for c in results))
        response = chat_response(choices, model=body.model or self.model_name, rid=new_id("cmpl"), **usage)
        response = {**response, "object": "text_completion"}
        if body.stream:
            return StreamingResponse(text_stream(response), media_type="text/event-stream")
        return response


def openai_routes(run, meta_info, model_name: str, renderer: ChatRenderer, max_requests: int, live=None) -> APIRouter:
    """``/v1/chat/completions`` and ``/v1/completions`` (``OpenAIHandlers`` says what they take)."""
    handlers = OpenAIHandlers(run, meta_info, model_name, renderer, max_requests, live)
    routes = APIRouter()
    routes.add_api_route("/v1/chat/completions", handlers.chat, methods=["POST"])
    routes.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    return routes
