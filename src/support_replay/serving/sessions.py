"""The session endpoint: OpenAI chat completions bound to a recorded trajectory (docs/agents.md).

    POST   /sessions                                   -> {"session_id": ...}
    POST   /sessions/{id}/v1/chat/completions          one turn (OpenAI schema; streamed as it is sampled)
    POST   /sessions/{id}/inference/v1/generate        one token-level turn (vLLM's generate shapes)
    GET    /sessions/{id}/v1/models
    POST   /v1/chat/completions, /inference/v1/generate            the session named by X-Session-ID
    POST   /tasks/{task}/v1/chat/completions (and generate)        the same, each id one sample of a task's group
    GET    /sessions/{id}                              turns, splits, state
    POST   /sessions/{id}/finish                       reward and metadata; no more turns
    GET    /sessions/{id}/trajectory                   the samples, token level, with replay data
    DELETE /sessions/{id}

Routes delegate to a ``SessionStore``; the trainer uses the same store in its own process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..backends.cancellation import Cancellation
from ..errors import AbortedError, EngineError, RequestError
from ..protocol import SESSION_HEADER, Completion, GenerateRequest
from ..rollout.chat import parses_tool_calls
from ..rollout.session import ChatTurn, SessionStore, TokenTurn, TurnResult
from . import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SESSIONS_PORT, NO_TELEMETRY
from .disconnects import unless_disconnected
from .health_routes import model_listing
from .http_errors import install_error_handlers
from .openai_format import chat_choice, chat_response, chat_stream, token_logprobs
from .openai_routes import as_log_mu
from .request_fields import check_undeclared
from .security import Keys, caller_of, guarded
from .session_streaming import live_turn
from .structured_outputs import response_format_grammar, tool_choice_grammar
from .vllm_routes import ROUTE as VLLM_GENERATE
from .vllm_routes import VLLMGenerateIn, generate_response

SETTINGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
)


class SessionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, lt=2**62)
    metadata: dict[str, Any] | None = None


class FinishIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    metadata: dict[str, Any] | None = None


class SessionChatIn(BaseModel):
    """OpenAI chat completions inside a session. Sampling fields are optional: left out, the
    run's rollout settings apply; given, they must equal them."""

    model_config = ConfigDict(extra="allow")  # other fields go by request_fields: a no-op, a default, or refused

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    return_meta_info: bool = False
    response_format: dict | None = None

    @model_validator(mode="after")
    def _declared_fields(self):
        check_undeclared(self.model_extra, "a session's /v1/chat/completions")
        return self

    def to_turn(self) -> ChatTurn:
        if self.n != 1:
            raise RequestError(f"n={self.n}: a session is one trajectory; send n=1 (or open a session per sample)")
        if self.stop:
            raise RequestError(
                "stop: stop strings are not taken inside a session (the turn ends at the model's end-of-turn token)"
            )
        format_grammar = response_format_grammar(self.response_format)
        call_grammar = tool_choice_grammar(self.tool_choice, self.tools)
        if format_grammar is not None and call_grammar is not None:
            raise RequestError("response_format and a forced tool_choice: give one structured-output constraint")
        parse_tools = parses_tool_calls(self.tool_choice)
        return ChatTurn(
            messages=self.messages,
            tools=self.tools if self.tools else None,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            seed=self.seed,
            sampling={k: getattr(self, k) for k in SETTINGS if getattr(self, k) is not None},
            logprobs=self.logprobs or bool(self.top_logprobs),
            parse_tools=parse_tools,
            top_logprobs=self.top_logprobs or 0,
            grammar=format_grammar or call_grammar,
        )


def turn_meta(store: SessionStore, sid: str, result: TurnResult) -> dict:
    """Replay metadata of one turn, only when asked: what the model sampled and its support."""
    c = result.completion
    session = store.get(sid)
    meta = {
        "session_id": public_id(session),
        "turn": session.turns - (1 if c is not None else 0),
        "split": result.split,
        "prompt_tokens": result.prompt_tokens,
    }
    if c is not None:
        meta.update(
            {
                "output_ids": c.output_ids,
                "finish_reason": c.finish_reason,
                "weight_versions": [s.to_json() for s in c.weight_versions],
            }
        )
        if c.support is not None:
            meta.update(
                {
                    "output_token_sampling_mask": c.support.to_lists(),
                    "output_token_sampling_logprobs": c.log_mu.tolist(),
                }
            )
    return meta


def public_id(session) -> str:
    """The id a client may see: its own X-Session-ID for a conversation it named (the internal id opens the
    session's URLs, and a client that did not make it has no business holding it)."""
    return session.client_id if session.client_id is not None else session.id


def _status(s) -> dict:
    """What both the state and the trajectory of a session say of it."""
    return {"session_id": s.id, "finished": s.finished, "failed": s.failed, "splits": s.splits, "metadata": s.metadata}


def token_turn(body: VLLMGenerateIn) -> TokenTurn:
    """A session's turn from vLLM's generate body: the run's settings apply (a sampling field given must equal
    them); what would make the trajectory other than what the trainer replays is refused by name."""
    sp = body.sampling_params
    given = sp.model_fields_set
    refused = {"n": 1, "min_tokens": 0, "ignore_eos": False, "stop": None, "include_stop_str_in_output": False}
    for name, default in refused.items():
        if name in given and getattr(sp, name) not in (default, [], ""):
            raise RequestError(
                f"sampling_params.{name}={getattr(sp, name)!r}: not taken inside a session (a session is one "
                "trajectory that ends at the model's end-of-turn or stop token)"
            )
    sampling = {k: getattr(sp, k) for k in SETTINGS if k in given}
    if "top_k" in sampling and sampling["top_k"] == 0:
        sampling["top_k"] = -1  # vLLM's 0 is no top-k
    if sp.logit_bias:
        sampling["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    return TokenTurn(
        token_ids=list(body.token_ids),
        max_tokens=sp.max_tokens,
        seed=sp.seed,
        sampling=sampling,
        logprobs=sp.logprobs is not None,
        top_logprobs=max(sp.logprobs or 0, 0),
        stop_token_ids=list(sp.stop_token_ids or []),
        skip_special_tokens=sp.skip_special_tokens,
    )


async def dropped_if_gone(work, request: Request):
    """``work(cancelled)``'s result; if the client goes away first, the turn is dropped at the engine (a turn
    whose client left ran to its end before, holding its slot)."""
    cancelled = Cancellation()

    async def gone(task):
        cancelled.set()
        try:  # its end is awaited: nothing is left running
            return await task
        except asyncio.CancelledError:
            raise AbortedError("the client went away: its turn was dropped at the engine") from None

    return await unless_disconnected(work(cancelled), request, gone)


class TurnAnswers:
    """A turn's answer, chat or tokens, in a session named by its id or opened by the client's own name for it
    (``X-Session-ID``; ``namespaced``: in the namespace of the API key it presented, where the server checks keys)."""

    def __init__(self, store: SessionStore, model_name: str, namespaced: bool):
        self.store, self.model_name, self.namespaced = store, model_name, namespaced
        self.eos = {store.renderer.tokenizer.eos_token_id}

    async def chat(self, sid, body: SessionChatIn, request: Request):
        """One chat turn; ``sid`` the session's id, or a function of the turn that opens it (a client-named
        conversation opens once the turn has passed its own checks)."""
        turn = body.to_turn()
        if callable(sid):
            return await sid(lambda opened: self._chat_turn(opened, body, turn, request))
        return await self._chat_turn(sid, body, turn, request)

    async def _chat_turn(self, sid: str, body: SessionChatIn, turn, request: Request):
        store, model = self.store, body.model or self.model_name
        usage = bool((body.stream_options or {}).get("include_usage"))

        def respond(result: TurnResult) -> dict:
            c = result.completion
            logprobs = None
            if turn.logprobs and c is not None:
                logprobs = token_logprobs(as_log_mu(c), store.renderer.decode, turn.top_logprobs)
            meta = turn_meta(store, sid, result) if body.return_meta_info else None
            return chat_response(
                [chat_choice(0, result.content, result.tool_calls, result.finish_reason, logprobs, meta)],
                model=model,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=c.num_tokens if c is not None else 0,
            )

        if body.stream and not (turn.tools and turn.parse_tools):  # tool calls parse from the whole text
            lines = await live_turn(store, sid, turn, model, respond, usage, request)
            return StreamingResponse(lines, media_type="text/event-stream")
        result = await dropped_if_gone(lambda cancelled: store.chat(sid, turn, cancelled=cancelled), request)
        response = respond(result)
        if body.stream:
            return StreamingResponse(chat_stream(response, usage), media_type="text/event-stream")
        return response

    async def tokens(self, sid, body: VLLMGenerateIn, http_request: Request):
        turn = token_turn(body)
        if callable(sid):
            return await sid(lambda opened: self._token_answer(opened, body, turn, http_request))
        return await self._token_answer(sid, body, turn, http_request)

    async def _token_answer(self, sid: str, body: VLLMGenerateIn, turn, http_request: Request):
        store = self.store
        request, completion = await dropped_if_gone(lambda gone: store.tokens(sid, turn, cancelled=gone), http_request)
        if completion is None:  # the episode's budget is spent: nothing generated, the trajectory as it was
            completion = Completion(output_ids=[], finish_reason={"type": "length"}, log_mu=np.zeros(0, np.float32))
            request = GenerateRequest(list(body.token_ids))
        return generate_response(
            body,
            [request],
            [as_log_mu(completion)],
            model=self.model_name,
            decode=store.renderer.decode,
            eos_ids=self.eos,
        )

    def keyed(self, request: Request, task: str | None):
        """The turn of the conversation the client names: opened on first sight, and gone again when that first
        turn is refused (4xx), so refused requests hold no place in the session table."""
        clients, client_id = self.store.clients, request.headers.get(SESSION_HEADER)
        caller = caller_of(request.headers.get("authorization")) if self.namespaced else ""

        async def run(turn):
            session, opened = clients.open_or_find(client_id, task, caller)
            try:
                return await turn(session.id)
            except EngineError as exc:
                if opened and exc.status < 500 and session.turns == 0:
                    clients.forget(client_id, task, caller, session.id)
                raise

        return run


def turn_routes(answers: TurnAnswers) -> APIRouter:
    """A turn, chat or tokens, in a session by id (``/sessions/<id>``), by the client's name for it (the root) and
    in a task scope (``/tasks/<task>``)."""
    routes = APIRouter()

    @routes.post("/sessions/{sid}/v1/chat/completions")
    async def session_chat(sid: str, request: Request, body: SessionChatIn):
        return await answers.chat(sid, body, request)

    @routes.post("/v1/chat/completions")
    async def client_chat(request: Request, body: SessionChatIn):
        return await answers.chat(answers.keyed(request, None), body, request)

    @routes.post("/tasks/{task}/v1/chat/completions")
    async def task_chat(task: str, request: Request, body: SessionChatIn):
        return await answers.chat(answers.keyed(request, task), body, request)

    @routes.post("/sessions/{sid}" + VLLM_GENERATE)
    async def session_tokens(sid: str, request: Request, body: VLLMGenerateIn):
        return await answers.tokens(sid, body, request)

    @routes.post(VLLM_GENERATE)
    async def client_tokens(request: Request, body: VLLMGenerateIn):
        return await answers.tokens(answers.keyed(request, None), body, request)

    @routes.post("/tasks/{task}" + VLLM_GENERATE)
    async def task_tokens(task: str, request: Request, body: VLLMGenerateIn):
        return await answers.tokens(answers.keyed(request, task), body, request)

    return routes


def lifecycle_routes(store: SessionStore, model_name: str) -> APIRouter:
    """A session's life: opened, its model, its state and trajectory, finished with a reward, deleted."""
    routes = APIRouter()

    @routes.post("/sessions")
    async def create(body: SessionIn | None = None):
        body = body or SessionIn()
        session = store.create(seed=body.seed, metadata=body.metadata)
        return {"session_id": session.id, "id": session.id}

    @routes.post("/tasks/{task}/finish")
    async def task_finish(task: str, request: Request, body: FinishIn | None = None):
        body = body or FinishIn()
        session = store.clients.find(request.headers.get(SESSION_HEADER), task)
        store.finish(session.id, body.reward, body.metadata)
        return {"session_id": public_id(session), "finished": True}

    @routes.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str):
        store.get(sid)
        return model_listing(model_name)

    @routes.get("/tasks/{task}/v1/models")
    async def task_models(task: str):
        store.clients.task_ids(task)
        return model_listing(model_name)

    @routes.get("/sessions/{sid}")
    async def state(sid: str):
        s = store.get(sid)
        samples = s.trajectories()
        response_tokens = sum(t.response_length for t in samples)
        return {**_status(s), "turns": s.turns, "samples": len(samples), "response_tokens": response_tokens}

    @routes.post("/sessions/{sid}/finish")
    async def finish(sid: str, body: FinishIn | None = None):
        body = body or FinishIn()
        s = store.finish(sid, body.reward, body.metadata)
        return {"session_id": s.id, "finished": True, "samples": len(s.trajectories())}

    @routes.get("/sessions/{sid}/trajectory")
    async def trajectory(sid: str):
        s = store.get(sid)
        return {**_status(s), "reward": s.reward, "samples": [t.to_json() for t in s.trajectories()]}

    @routes.delete("/sessions/{sid}")
    async def delete(sid: str):
        store.delete(sid)
        return {"session_id": sid, "deleted": True}

    return routes


def session_routes(store: SessionStore, model_name: str = "support-replay", namespaced: bool = False) -> APIRouter:
    """A session's routes under ``/sessions/<id>``; its turns also under ``/tasks/<task>`` and at the root for a
    client that names its conversations with ``X-Session-ID``."""
    routes = APIRouter()
    routes.include_router(lifecycle_routes(store, model_name))
    routes.include_router(turn_routes(TurnAnswers(store, model_name, namespaced)))
    return routes


def create_sessions_app(
    store: SessionStore,
    *,
    model_name: str = "support-replay",
    keys: Keys | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: list[str] | None = None,
    session_urls_open: bool = False,
):
    """The ASGI app: session routes inside the same guards as the engine server's (Host check,
    body limit, JSON only, the API key on everything but /health). ``session_urls_open``: a
    session's own routes (``/sessions/<id>/...``) need no key, its random id being the secret (the
    trainer's own server: its agents get a session URL, and plain-HTTP agents send no key)."""
    app = FastAPI(title="support-replay sessions", telemetry=NO_TELEMETRY)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(store)}

    @app.get("/v1/models")
    async def models():
        return model_listing(model_name)

    app.include_router(session_routes(store, model_name, namespaced=(keys or Keys()).api is not None))
    open_paths = ("/health", "/sessions/", "/tasks/") if session_urls_open else ("/health",)
    return guarded(
        app, keys or Keys(), (), open_paths, allowed_hosts=allowed_hosts, max_request_bytes=max_request_bytes
    )


def serve_sessions(store: SessionStore, host: str = "127.0.0.1", port: int = DEFAULT_SESSIONS_PORT, **kwargs) -> None:
    import uvicorn

    from .connections import uvicorn_config
    from .server import allowed_hosts_for, announce_exposure

    announce_exposure(host, kwargs.get("keys") or Keys())
    connections = kwargs.pop("connections", None)
    app = create_sessions_app(store, allowed_hosts=allowed_hosts_for(host, kwargs.pop("allowed_hosts", None)), **kwargs)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, connections)).run()
    finally:
        store.close()
