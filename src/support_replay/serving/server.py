"""FastAPI server over an ``Engine``: SGLang ``/generate``, the OpenAI surface (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``: ``openai_routes.py``), health, model info, weight
updates. Handlers parse, delegate to the engine, and format."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..core import wire
from ..engine import Engine
from ..errors import ConfigError, EngineError, OverloadedError, RequestError, SupportReplayError
from ..protocol import Completion, GenerateRequest
from ..rollout.chat import ChatRenderer
from . import DEFAULT_ENGINE_PORT, DEFAULT_MAX_REQUEST_BYTES, NO_TELEMETRY
from .disconnects import unless_disconnected
from .http_errors import engine_error_response, error_response, install_error_handlers
from .metrics import render_metrics
from .openai_routes import openai_routes
from .schemas import GenerateIn, SamplingParamsIn, UpdateWeightsIn, UpdateWeightVersionIn, check_fan_out
from .security import DEFAULT_MAX_WEIGHTS_BYTES, LOOPBACK_HOSTS, WEIGHTS_OVER_HTTP, Keys, exposure_warnings, guarded


def meta_info(completion: Completion, request: GenerateRequest, *, sampling_mask_format: str, vocab_size: int) -> dict:
    """SGLang's ``meta_info`` of one completion, in SGLang 0.5.23's shapes (docs/engines.md).

    The support goes as id lists (SGLang's form) unless the client asked for our binary
    form; ``output_token_sampling_mask_length`` is the number of rows, as SGLang sends it.
    """
    meta = {
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": completion.num_tokens,
        "weight_version": completion.weight_version,
        "weight_versions": [span.to_json() for span in completion.weight_versions],
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(completion.full_logprobs.tolist(), completion.output_ids)
        ]
    if request.return_sampling_mask:
        support = completion.support
        if sampling_mask_format == "binary":
            meta["output_token_sampling_mask"] = wire.to_json(support, vocab_size, completion.output_ids)
        else:
            meta["output_token_sampling_mask"] = support.to_lists()
        if request.sampling_logprobs_mode == "support":
            meta["output_token_sampling_logprobs"] = [row.tolist() for row in completion.support_row_logprobs]
        else:
            meta["output_token_sampling_logprobs"] = completion.log_mu.tolist()
        meta["output_token_sampling_mask_length"] = support.num_rows
    return meta


ADMIN_PATHS = ("/update_weights_from_disk", WEIGHTS_OVER_HTTP, "/update_weight_version", "/flush_cache")
OPEN_PATHS = ("/health", "/metrics")


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
    keys = keys or Keys()
    weights_dir = Path(weights_dir).resolve() if weights_dir else None
    app = FastAPI(title="support-replay engine", telemetry=NO_TELEMETRY)

    install_error_handlers(app)

    async def run(requests, http_request: Request) -> list[Completion]:
        """Submit, wait, and drop the requests from the engine if the client goes away meanwhile."""
        futures = engine.submit_all(requests)  # admitted together: a group shares its prompt's prefill
        answers = asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)

        def abort_all(task):  # the client went away: the engine drops them; their (aborted) answers still come
            for f in futures:
                engine.abort(f)
            return task

        results = await unless_disconnected(answers, http_request, abort_all)
        for r in results:
            if isinstance(r, BaseException):
                raise r if isinstance(r, SupportReplayError) else EngineError(f"internal engine error: {r}")
        return results

    def tokenize_prompt(text: str) -> list[int]:
        return engine.tokenizer(text)["input_ids"]

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(engine), media_type=CONTENT_TYPE_LATEST)

    started = int(time.time())

    @app.get("/v1/models")
    async def models():
        # what OpenAI clients ask first; smg registers a worker only after a probe answers
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": started,
                    "owned_by": "support-replay",
                    "root": model_name,
                }
            ],
        }

    # SGLang's /server_info and no /version: smg 1.13 takes a worker with /version for vLLM
    # and one with /server_info alone for SGLang, whose protocol this server speaks
    @app.get("/server_info")
    async def server_info():
        return {**(await model_info()), "version": __version__}

    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": model_name,
            "is_generation": True,
            "vocab_size": engine.vocab_size,
            "semantics": engine.semantics,
            "sampling_mask_max_tokens": engine.capacity,
            "weight_version": engine.weight_version,
            "deterministic": engine.deterministic,
            "linear_kernel": engine.linear_kernel,
            "invariant_products": engine.invariant_plans,
            "limits": engine.limits.to_json(),
            "max_total_tokens": engine.kv_budget.max_total_tokens,
        }

    @app.post("/generate")
    async def generate(request: Request, body: GenerateIn):
        prompts = body.text if body.text is not None else body.input_ids
        prompts = prompts if body.batched else [prompts]
        check_fan_out(len(prompts), 1, engine.limits.max_queue)
        prompts = [tokenize_prompt(p) if isinstance(p, str) else p for p in prompts]
        sp = body.sampling_params if body.sampling_params is not None else SamplingParamsIn()
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        rl = body.return_logprob if isinstance(body.return_logprob, list) else [body.return_logprob] * len(prompts)
        if len(sps) != len(prompts) or len(rl) != len(prompts):
            raise RequestError(
                f"sampling_params / return_logprob: {len(sps)} / {len(rl)} entries for {len(prompts)} prompts"
            )
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        if len(rids) != len(prompts) or (body.rid is not None and not body.batched and isinstance(body.rid, list)):
            raise RequestError(f"rid: {len(rids)} ids for {len(prompts)} prompts")
        if body.batched and isinstance(body.rid, str):
            rids = [f"{body.rid}-{i}" for i in range(len(prompts))]  # SGLang's rule for one id over a batch
        reqs = [
            s.to_request(
                p,
                return_sampling_mask=body.return_sampling_mask,
                return_logprob=r,
                sampling_logprobs_mode=body.sampling_logprobs_mode,
                rid=i,
            )
            for p, s, r, i in zip(prompts, sps, rl, rids)
        ]
        results = await run(reqs, request)
        out = [
            {
                "text": res.text,
                "output_ids": res.output_ids,
                "meta_info": {
                    "id": uuid.uuid4().hex,
                    **meta_info(res, req, sampling_mask_format=body.sampling_mask_format, vocab_size=engine.vocab_size),
                },
            }
            for req, res in zip(reqs, results)
        ]
        return out if body.batched else out[0]

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsIn):
        path = Path(body.model_path).resolve()
        if weights_dir is None:
            return error_response(
                403, "weight loading is off: start the server with --weights-dir DIR to load safetensors from under DIR"
            )
        if not path.is_relative_to(weights_dir):
            return error_response(
                403, f"model_path {body.model_path!r} is not under the weights directory {str(weights_dir)!r}"
            )
        outside = [
            f
            for f in (path.glob("*.safetensors") if path.is_dir() else [])
            if not f.resolve().is_relative_to(weights_dir)
        ]
        if outside:  # a link inside the directory to a file elsewhere
            return error_response(
                403,
                f"model_path {body.model_path!r}: {outside[0].name} resolves outside the weights directory {str(weights_dir)!r}",
            )
        version = await asyncio.wrap_future(
            engine.update_weights_from_disk(path, body.weight_version, abort_all_requests=body.abort_all_requests)
        )
        return {"success": True, "message": f"loaded {body.model_path}", "weight_version": version}

    @app.post(WEIGHTS_OVER_HTTP)
    async def update_weights_from_safetensors(
        request: Request, weight_version: str | None = Query(None, max_length=256), abort_all_requests: bool = False
    ):
        """The weights as one safetensors file in the body (no pickle: nothing in it runs), for a
        trainer that shares no filesystem with the engine; admin key required, checked like
        ``update_weights_from_disk`` (names and shapes) before anything is loaded."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        body = await request.body()
        try:
            state = load_safetensors(body)
        except (SafetensorError, ValueError) as exc:
            return error_response(400, f"body: not a safetensors file ({len(body)} bytes): {exc}")
        version = await asyncio.wrap_future(
            engine.update_weights(state, weight_version, abort_all_requests=abort_all_requests)
        )
        return {
            "success": True,
            "message": f"loaded {len(state)} tensors ({len(body)} bytes)",
            "weight_version": version,
        }

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionIn):
        version = await asyncio.wrap_future(engine.update_weight_version(body.new_version))
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    @app.post("/flush_cache")
    async def flush_cache():
        # The engine keeps no prefix cache between requests: there is nothing stale to drop.
        return {"success": True, "message": "no prefix cache to flush"}

    renderer = ChatRenderer(engine.tokenizer, chat_template)
    app.include_router(
        openai_routes(
            run,
            lambda c, req, fmt: meta_info(c, req, sampling_mask_format=fmt, vocab_size=engine.vocab_size),
            model_name,
            renderer,
            engine.limits.max_queue,
        )
    )
    return guarded(
        QueueGate(app, engine),
        keys,
        ADMIN_PATHS,
        OPEN_PATHS,
        allowed_hosts=allowed_hosts,
        max_request_bytes=max_request_bytes,
        binary_paths={WEIGHTS_OVER_HTTP: max_weights_bytes},
    )


GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


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

    from .threaded import ThreadedServer

    announce_exposure(host, kwargs.get("keys") or Keys(), kwargs.get("weights_dir"))
    app = create_app(
        engine, allowed_hosts=allowed_hosts_for(host, kwargs.pop("allowed_hosts", None)), start_engine=False, **kwargs
    )
    try:
        server = ThreadedServer(app, host, port, lifespan="auto").start()
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"serve: {host}:{port}: {exc}") from exc
    previous = signal.signal(
        signal.SIGTERM, lambda *_: engine.shutdown()
    )  # stops the loop; the finally below stops uvicorn
    # the model, tokenizer and libraries live as long as the process: out of the cyclic collector's scans, whose
    # full passes over them held the GIL for 100-300 ms under load (/health p99 0.25 s -> 0.06 s, docs/reliability.md)
    gc.freeze()
    try:
        engine.run(alive=server.thread.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        died = not server.thread.is_alive()  # uvicorn's thread ended by itself
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
