"""Health and metrics of the engine server (open paths: no key), and the OpenAI model listing."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine import Engine
from .metrics import render_metrics

OPEN_PATHS = ("/health", "/metrics")


def model_listing(model_name: str, created: int | None = None) -> dict:
    """``/v1/models``: what OpenAI clients ask first (smg registers a worker only after a probe answers)."""
    entry = {"id": model_name, "object": "model", "owned_by": "support-replay"}
    if created is not None:
        entry.update(created=created, root=model_name)
    return {"object": "list", "data": [entry]}


def health_routes(engine: Engine, model_name: str) -> APIRouter:
    routes = APIRouter()
    started = int(time.time())

    @routes.get("/health")
    async def health():
        return {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}

    @routes.get("/metrics")
    async def metrics():
        return Response(render_metrics(engine), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/v1/models")
    async def models():
        return model_listing(model_name, started)

    return routes
