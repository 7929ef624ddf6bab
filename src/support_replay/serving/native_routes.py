"""SGLang's native routes: ``/generate`` (in SGLang's shapes), ``/model_info`` and ``/server_info``."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .. import __version__
from ..modeling.tokenizer_identity import tokenizer_fingerprint
from .engine_calls import EngineCalls
from .openai_format import _sse
from .openai_streaming import error_body
from .schemas import GenerateIn
from .security import caller_of
from .sglang_format import ResponseForm


def namespaced(reqs: list, authorization: str | None) -> list:
    """Request ids in the namespace of the key presented: one client's ``rid`` never answers, joins or 409s another
    key's request (a server without keys has one caller, and one namespace). The id is never sent back."""
    caller = caller_of(authorization)
    if not caller:
        return reqs

    def rid(r) -> str:
        return f"{caller}:{hashlib.blake2b(r.rid.encode(), digest_size=16).hexdigest()}"

    return [replace(r, rid=rid(r)) if r.rid is not None else r for r in reqs]


def engine_info(engine, model_name: str) -> dict:
    """``/model_info``: what the engine computes with and holds (the trainer's handshake reads it)."""
    return {
        "model_path": model_name,
        "is_generation": True,
        "vocab_size": engine.vocab_size,
        "semantics": engine.semantics,
        "sampling_mask_max_tokens": engine.capacity,
        "weight_version": engine.weight_version,
        "deterministic": engine.deterministic,
        "linear_kernel": engine.linear_kernel,
        "decode_attention": engine.decode_attention,
        "invariant_arithmetic": engine.invariant_identity,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "limits": engine.limits.to_json(),
        "max_total_tokens": engine.kv_budget.max_total_tokens,
        "page_size": engine.runner.pool.block_size,
        "kv_blocks": {"total": engine.runner.pool.blocks, "used": engine.runner.pool.used},
        "prefix_cache": engine.prefix_cache.to_json(),
    }


def answer(calls: EngineCalls, req, res, fmt, rid: str) -> dict:
    """One ``/generate`` answer in SGLang's shape."""
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": {"id": rid, **calls.meta_info(res, req, fmt)}}


def streamed(calls: EngineCalls, req, fmt) -> StreamingResponse:
    """SGLang 0.5.23's stream (its default, non-incremental): a chunk per token with the ids and text so far,
    then the whole answer as the last chunk (the support, log mu and the rest of ``meta_info``), then
    ``[DONE]``. A client that goes away aborts the request."""
    stream = calls.token_stream([req])
    refused = stream.refused()
    if refused is not None:
        stream.abort()
        raise refused
    text, rid = calls.incremental_text(req), uuid.uuid4().hex
    progress = {"id": rid, "finish_reason": None, "prompt_tokens": len(req.input_ids)}

    async def lines():
        ids: list[int] = []
        try:
            async for kind, _, value in stream.events():
                if kind == "token":
                    ids.append(value)
                    text.push(value)
                    yield _sse(
                        {"text": text.sent, "output_ids": ids, "meta_info": {**progress, "completion_tokens": len(ids)}}
                    )
                elif value.exception() is not None:
                    yield _sse(error_body(value.exception()))
                else:
                    yield _sse(answer(calls, req, value.result(), fmt, rid))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()

    return StreamingResponse(lines(), media_type="text/event-stream")


def native_routes(calls: EngineCalls, model_name: str) -> APIRouter:
    routes = APIRouter()
    engine = calls.engine

    fingerprint = tokenizer_fingerprint(engine.tokenizer)  # a teacher's student checks it (train/teacher.py)

    @routes.get("/model_info")
    async def model_info():
        return {**engine_info(engine, model_name), "tokenizer_fingerprint": fingerprint}

    # SGLang's /server_info and no /version: smg 1.13 takes a worker with /version for vLLM
    # and one with /server_info alone for SGLang, whose protocol this server speaks
    @routes.get("/server_info")
    async def server_info():
        return {**engine_info(engine, model_name), "version": __version__}

    @routes.post("/generate")
    async def generate(request: Request, body: GenerateIn):
        if body.text is not None:  # tokenized off the event loop
            reqs = await asyncio.to_thread(body.to_requests, calls.tokenize, engine.limits.max_queue)
        else:
            reqs = body.to_requests(calls.tokenize, engine.limits.max_queue)
        reqs = namespaced(reqs, request.headers.get("authorization"))
        fmt = ResponseForm(body.sampling_mask_format, body.routed_experts_format, body.routed_experts_start_len)
        calls.check_json_bound(reqs, fmt)
        if body.stream:
            await calls.prepare(reqs)
            return streamed(calls, reqs[0], fmt)
        results = await calls.run(reqs, request)
        calls.check_json(reqs, results, fmt)
        out = [answer(calls, req, res, fmt, uuid.uuid4().hex) for req, res in zip(reqs, results)]
        return out if body.batched else out[0]

    return routes
