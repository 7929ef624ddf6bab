"""Live SSE for the OpenAI routes: text deltas leave as the engine samples them (``token_stream.py``),
each choice ends with the rest of its text, its log-probs and its finish reason, then usage if asked
and ``[DONE]``. A client that goes away aborts what still runs; a request that fails mid-stream
ends the stream with OpenAI's error object (the status line has gone already)."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import EngineError
from ..protocol import Completion
from .openai_format import _sse
from .token_stream import IncrementalText, TokenStream


def error_body(exc: BaseException) -> dict:
    """OpenAI's error object for a request that failed after its stream began (the status line has gone)."""
    status = exc.status if isinstance(exc, EngineError) else 500
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": str(exc), "type": kind, "code": status}}


async def live_sse(
    stream: TokenStream,
    texts: list[IncrementalText],
    *,
    opening: list[dict],
    delta: Callable[[int, str], dict],
    ending: Callable[[int, Completion, IncrementalText], list[dict]],
    usage: Callable[[dict[int, Completion]], dict | None],
):
    """The SSE lines of one streamed body: ``opening`` chunks, a ``delta(i, text)`` chunk per text delta of
    choice ``i``, ``ending(i, completion, text)`` chunks when it is done, the ``usage`` chunk, ``[DONE]``."""
    try:
        for chunk in opening:
            yield _sse(chunk)
        done: dict[int, Completion] = {}
        async for kind, i, value in stream.events():
            if kind == "token":
                text = texts[i].push(value)
                if text:
                    yield _sse(delta(i, text))
                continue
            if value.exception() is not None:
                yield _sse(error_body(value.exception()))
                break
            done[i] = value.result()
            for chunk in ending(i, done[i], texts[i]):
                yield _sse(chunk)
        else:
            last = usage(done)
            if last is not None:
                yield _sse(last)
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()
