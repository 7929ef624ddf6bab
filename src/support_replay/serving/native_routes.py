"""SGLang's native routes: ``/generate`` (in SGLang's shapes), ``/model_info`` and ``/server_info``."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from .. import __version__
from .engine_calls import EngineCalls
from .schemas import GenerateIn
from .sglang_format import ResponseForm


def native_routes(calls: EngineCalls, model_name: str) -> APIRouter:
    routes = APIRouter()
    engine = calls.engine

    @routes.get("/model_info")
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
            "prefix_cache": engine.prefix_cache.to_json(),
        }

    # SGLang's /server_info and no /version: smg 1.13 takes a worker with /version for vLLM
    # and one with /server_info alone for SGLang, whose protocol this server speaks
    @routes.get("/server_info")
    async def server_info():
        return {**(await model_info()), "version": __version__}

    @routes.post("/generate")
    async def generate(request: Request, body: GenerateIn):
        reqs = body.to_requests(calls.tokenize, engine.limits.max_queue)
        results = await calls.run(reqs, request)
        fmt = ResponseForm(body.sampling_mask_format, body.routed_experts_format, body.routed_experts_start_len)
        out = [
            {
                "text": res.text,
                "output_ids": res.output_ids,
                "meta_info": {"id": uuid.uuid4().hex, **calls.meta_info(res, req, fmt)},
            }
            for req, res in zip(reqs, results)
        ]
        return out if body.batched else out[0]

    return routes
