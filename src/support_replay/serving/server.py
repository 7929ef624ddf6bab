"""The engine server: an ``Engine`` behind FastAPI routers by concern, inside the guards.

    native_routes.py   SGLang's /generate, /model_info, /server_info
    teacher_routes.py  /score_support: the engine as a distillation teacher
    openai_routes.py   /v1/chat/completions, /v1/completions
    vllm_routes.py     vLLM's token-in/token-out /inference/v1/generate
    admin_routes.py    weight updates, the weight version, /flush_cache (admin key)
    health_routes.py   /health, /metrics (open), /v1/models

Handlers validate (schemas.py), delegate to the engine (engine_calls.py) and shape the answer
(sglang_format.py, openai_format.py)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from ..engine import Engine
from ..errors import ConfigError, EngineError, OverloadedError
from ..rollout.chat import ChatRenderer
from ..rollout.text_bound import TextBound
from . import DEFAULT_ENGINE_PORT, DEFAULT_MAX_REQUEST_BYTES, NO_TELEMETRY
from .admin_routes import admin_routes
from .engine_calls import EngineCalls
from .health_routes import OPEN_PATHS, health_routes
from .http_errors import engine_error_response, install_error_handlers
from .native_routes import native_routes
from .openai_routes import openai_routes
from .security import (
    ADMIN_PATHS,
    DEFAULT_MAX_WEIGHTS_BYTES,
    LOOPBACK_HOSTS,
    WEIGHTS_OVER_HTTP,
    Keys,
    exposure_warnings,
    guarded,
)
from .teacher_routes import teacher_routes
from .vllm_routes import ROUTE as VLLM_GENERATE
from .vllm_routes import vllm_routes


def create_app(
    engine: Engine,
    *,
    keys: Keys | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    model_name: str = "support-replay",
    weights_dir: str | Path | None = None,
    allowed_hosts: list[str] | None = None,
    chat_template: str | None = None,
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
    start_engine: bool = True,
):
    """The ASGI app: FastAPI routes inside the Host check, the body limit and the JSON-only rule.
    Its routes wait on the engine's futures, so the engine's loop thread is started here unless
    ``start_engine`` is off (``serve`` runs the loop on its main thread)."""
    if start_engine:
        engine.start()
    app = FastAPI(title="support-replay engine", telemetry=NO_TELEMETRY)
    install_error_handlers(app)
    bound = TextBound.of(engine.tokenizer, engine.limits.max_prompt_tokens)  # text refused before it is tokenized
    calls = EngineCalls(engine, bound)
    renderer = ChatRenderer(engine.tokenizer, chat_template, bound)
    app.include_router(health_routes(engine, model_name))
    app.include_router(native_routes(calls, model_name))
    app.include_router(admin_routes(engine, Path(weights_dir).resolve() if weights_dir else None))
    app.include_router(
        openai_routes(calls.run, calls.meta_info, model_name, renderer, engine.limits.max_queue, live=calls)
    )
    app.include_router(vllm_routes(calls.run, model_name, engine, renderer.decode))
    app.include_router(teacher_routes(engine))
    return guarded(
        QueueGate(app, engine),
        keys or Keys(),
        ADMIN_PATHS,
        OPEN_PATHS,
        allowed_hosts=allowed_hosts,
        max_request_bytes=max_request_bytes,
        binary_paths={WEIGHTS_OVER_HTTP: max_weights_bytes},
    )


GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", VLLM_GENERATE)


class QueueGate:
    """503 for a generation request while the engine's queue is full, before its body is parsed (it
    is read, so the connection stays open for the client's retry): under a burst most requests are
    turned away, and each costs the event loop almost nothing, so ``/health`` and the admitted
    requests keep their latency (docs/reliability.md). A repeated ``rid`` is answered once there is
    room again (the client's retry)."""

    def __init__(self, app, engine: Engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            queue = self.engine.limits.max_queue
            if self.engine.num_waiting >= queue:
                while (await receive()).get("more_body"):  # read, not parsed: the connection stays usable
                    pass
                self.engine.ledger.count("overloaded")
                return await engine_error_response(OverloadedError.queue_full(queue))(scope, receive, send)
        return await self.app(scope, receive, send)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = DEFAULT_ENGINE_PORT, **kwargs) -> None:
    """Serve until SIGINT or SIGTERM: uvicorn on a thread, the engine's loop on this (main) thread,
    the one that loaded the model, so a single OpenMP pool computes (Engine.wait says why)."""
    import gc
    import signal
    import threading

    from .threaded import ThreadedServer

    announce_exposure(host, kwargs.get("keys") or Keys(), kwargs.get("weights_dir"))
    connections = kwargs.pop("connections", None)
    app = create_app(
        engine, allowed_hosts=allowed_hosts_for(host, kwargs.pop("allowed_hosts", None)), start_engine=False, **kwargs
    )
    try:
        server = ThreadedServer(app, host, port, lifespan="auto", connections=connections).start()
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"serve: {host}:{port}: {exc}") from exc
    # SIGTERM stops the loop and the finally below stops uvicorn; only the main thread can hold a handler (ray-run's
    # engine actors serve from a thread of their own: Ray ends them)
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: engine.shutdown()) if on_main else None
    # the model, tokenizer and libraries live as long as the process: out of the cyclic collector's scans, whose
    # full passes over them held the GIL for 100-300 ms under load (/health p99 0.25 s -> 0.06 s, docs/reliability.md)
    gc.freeze()
    try:
        engine.run(alive=server.thread.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        died = not server.thread.is_alive()  # uvicorn's thread ended by itself
        if on_main:
            signal.signal(signal.SIGTERM, previous)
        engine.shutdown()
        server.stop()
    if died:
        raise EngineError(f"serve: the HTTP server at {host}:{port} stopped unexpectedly (its log above says why)")


def announce_exposure(host: str, keys: Keys, weights_dir=None) -> None:
    """Warn on stderr about what a non-loopback bind leaves open; refuse what it must not (security.py)."""
    import sys

    for warning in exposure_warnings(host, keys, weights_dir):
        print(f"support-replay: warning: {warning}", file=sys.stderr, flush=True)


def allowed_hosts_for(host: str, given: list[str] | None) -> list[str]:
    """Host headers a server bound to ``host`` answers: the loopback names when it is loopback-only."""
    if given:
        return given
    if host in ("0.0.0.0", "::"):
        return ["*"]
    return sorted({*LOOPBACK_HOSTS, host})
