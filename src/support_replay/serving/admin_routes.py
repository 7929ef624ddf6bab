"""Admin routes of the engine server: weight updates (from a directory under ``--weights-dir``, or
one safetensors file in the body), a LoRA adapter from a directory under it (SGLang's
``/load_lora_adapter`` and ``/unload_lora_adapter``), the weight version's name, ``/flush_cache``, and SGLang's
``/pause_generation`` and ``/continue_generation`` (weights changed under running requests: engine/pausing.py) and
``/abort_request`` (a request ended with the tokens it has)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ..engine import Engine
from ..engine.weight_updates import CheckedPath, outside
from ..errors import RequestError
from .http_errors import error_response
from .schemas import (
    AbortRequestIn,
    ContinueGenerationIn,
    LoadLoRAAdapterIn,
    PauseGenerationIn,
    UnloadLoRAAdapterIn,
    UpdateWeightsIn,
    UpdateWeightVersionIn,
)
from .security import WEIGHTS_OVER_HTTP


def refused_weights_path(model_path: str, weights_dir: Path | None) -> str | None:
    """Why ``model_path`` may not be loaded (403), or None: it must lie under ``--weights-dir``, and so must
    every entry of the directory it names once links are resolved (engine/weight_updates.outside)."""
    if weights_dir is None:
        return "weight loading is off: start the server with --weights-dir DIR to load safetensors from under DIR"
    refused = outside(Path(model_path), weights_dir)
    return None if refused is None else f"model_path {refused}"


def upload_limit(engine: Engine) -> int:
    """The largest weights body a model may take: its parameters in float32, and 16 MiB of header."""
    return 4 * sum(t.numel() for t in engine.runner.model.state_dict().values()) + 16 * 2**20


def too_large(size: int, limit: int) -> str:
    return f"body: {size:,} bytes is more than this model's weights take in float32 with a header ({limit:,} bytes)"


async def receive_to(request: Request, path: Path, limit: int) -> int:
    """Write the body to ``path`` as it arrives; stop past ``limit`` bytes. Returns the bytes received."""
    size = 0
    with open(path, "wb") as out:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                break
            await asyncio.to_thread(out.write, chunk)
    return size


def safetensors_header(path: Path) -> None:
    """ValueError unless ``path`` opens as safetensors (its header read, no tensor)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(str(exc)) from exc


def admin_routes(engine: Engine, weights_dir: Path | None) -> APIRouter:
    """Every admin route: the weights, the adapters, the version's name and the prefix cache."""
    routes = APIRouter()
    routes.include_router(weight_routes(engine, weights_dir))
    routes.include_router(adapter_routes(engine, weights_dir))

    @routes.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionIn):
        version = await asyncio.wrap_future(engine.update_weight_version(body.new_version))
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    @routes.post("/pause_generation")
    async def pause_generation(body: PauseGenerationIn):
        paused = await asyncio.wrap_future(engine.pause_generation(body.mode))
        return {"message": "Generation paused successfully.", "status": "ok", "mode": body.mode, "requests": paused}

    @routes.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationIn | None = None):
        resumed = await asyncio.wrap_future(engine.continue_generation())
        return {"message": "Generation continued successfully.", "status": "ok", "recomputed": resumed}

    @routes.post("/abort_request")
    async def abort_request(body: AbortRequestIn):
        """SGLang's: the request (or all) ends now, its client answered with the tokens so far, finish reason
        ``abort`` (Engine.stop)."""
        stopped = engine.stop_request(None if body.abort_all else body.rid)
        return {"success": True, "stopped": stopped}

    @routes.post("/flush_cache")
    async def flush_cache():
        entries = engine.flush_prefix_cache()  # emptied by the engine's loop before its next step
        return {"success": True, "message": f"prefix cache: {entries} entries dropped"}

    return routes


def weight_routes(engine: Engine, weights_dir: Path | None) -> APIRouter:
    """New weights from a folder under ``--weights-dir``, or as a safetensors body."""
    routes = APIRouter()

    @routes.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsIn):
        refused = refused_weights_path(body.model_path, weights_dir)
        if refused:
            return error_response(403, refused)
        update = engine.update_weights_from_disk(  # checked again on the engine's thread as it is read
            CheckedPath(Path(body.model_path), weights_dir),
            body.weight_version,
            abort_all_requests=body.abort_all_requests,
        )
        version = await asyncio.wrap_future(update)
        return {"success": True, "message": f"loaded {body.model_path}", "weight_version": version}

    @routes.post(WEIGHTS_OVER_HTTP)
    async def update_weights_from_safetensors(
        request: Request, weight_version: str | None = Query(None, max_length=256), abort_all_requests: bool = False
    ):
        """The weights as one safetensors file in the body (no pickle: nothing in it runs), for a
        trainer that shares no filesystem with the engine; admin key required, checked like
        ``update_weights_from_disk`` (names and shapes) before anything is loaded. The body goes to a
        temporary file as it arrives (it was read whole into memory, up to 64 GiB, beside its tensors), and
        may be at most what this model's weights take in float32 and a header: 413 beyond."""
        limit = upload_limit(engine)
        declared = int(request.headers.get("content-length") or 0)
        if declared > limit:
            return error_response(413, too_large(declared, limit))
        with tempfile.TemporaryDirectory(prefix="support-replay-upload-") as folder:
            path = Path(folder) / "weights.safetensors"
            size = await receive_to(request, path, limit)
            if size > limit:
                return error_response(413, too_large(size, limit))
            try:
                await asyncio.to_thread(safetensors_header, path)
            except ValueError as exc:
                return error_response(400, f"body: not a safetensors file ({size} bytes): {exc}")
            update = engine.update_weights_from_disk(path, weight_version, abort_all_requests=abort_all_requests)
            version = await asyncio.wrap_future(update)  # read by the engine's thread before the folder goes
        message = f"loaded {size} bytes of safetensors"
        return {"success": True, "message": message, "weight_version": version}

    return routes


def adapter_routes(engine: Engine, weights_dir: Path | None) -> APIRouter:
    """SGLang's LoRA adapter routes: load one from a folder under ``--weights-dir``, unload one."""
    routes = APIRouter()

    async def adapter_update(start):
        """SGLang's ``LoRAUpdateOutput``: 200 with the adapters loaded, or 400 with ``success: false``."""
        try:
            await asyncio.wrap_future(start())
        except RequestError as exc:  # SGLang's fields beside our error object
            return JSONResponse(
                {"success": False, "error_message": str(exc), "error": {"message": str(exc), "code": 400}},
                status_code=400,
            )
        return {"success": True, "error_message": None, "loaded_adapters": engine.adapters.listing()}

    @routes.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterIn):
        refused = refused_weights_path(body.lora_path, weights_dir)
        if refused:
            return error_response(403, refused.replace("model_path", "lora_path"))
        return await adapter_update(lambda: engine.load_lora_adapter(body.lora_name, Path(body.lora_path).resolve()))

    @routes.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterIn):
        return await adapter_update(lambda: engine.unload_lora_adapter(body.lora_name))

    return routes
