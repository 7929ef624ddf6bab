"""How our exceptions and pydantic's become HTTP answers, in OpenAI's error shape; shared by
the engine server and the session server."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..errors import EngineError, OverloadedError


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


MAX_ERRORS_SHOWN = 5  # a hostile body can fail a million items: name the first few


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_ERRORS_SHOWN]:
        # pydantic's own steps (``function-after[...]``, a union's ``list[...]``) are no field names
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and "[" not in str(p))
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    more = len(errors) - MAX_ERRORS_SHOWN
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        return error_response(400, validation_message(exc))

    @app.exception_handler(EngineError)
    async def on_engine_error(_, exc: EngineError):
        return engine_error_response(exc)


def engine_error_response(exc: EngineError) -> JSONResponse:
    """Our exception as its HTTP answer (a full queue's 503 with ``Retry-After``)."""
    response = error_response(exc.status, str(exc), "invalid_request_error" if exc.status < 500 else "server_error")
    if isinstance(exc, OverloadedError):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response
