"""A session's turn streamed as it is sampled: OpenAI chat chunks whose text deltas leave as the engine samples
the tokens (``token_stream.IncrementalText``), then the rest of the answer, its log-probs and finish reason,
usage if asked and ``[DONE]``; the deltas concatenate to the whole answer's content. A turn refused before its
first token (a busy session, a history the policy rejects) is a plain HTTP error; one that fails later ends the
stream with OpenAI's error object. A client that goes away drops the turn at the engine (the session records
nothing of it). Turns that parse tool calls stream once whole (the calls parse from the whole text)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.requests import Request

from ..backends.cancellation import Cancellation
from ..errors import AbortedError
from ..rollout.session import ChatTurn, SessionStore
from .disconnects import unless_disconnected
from .openai_format import _sse, new_id
from .openai_streaming import error_body
from .token_stream import IncrementalText


async def live_turn(
    store: SessionStore, sid: str, turn: ChatTurn, model: str, respond, include_usage: bool, request: Request
):
    """The SSE lines of one streamed turn; ``respond(result)`` builds the whole answer's response. A client that
    leaves before the first token (its turn queued or prefilling) drops the turn too."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = Cancellation()

    def on_token(request, token: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("token", request, token))

    task = asyncio.ensure_future(store.chat(sid, turn, on_token=on_token, cancelled=cancelled))
    task.add_done_callback(lambda _: queue.put_nowait(("done", None, None)))

    async def gone(_):
        cancelled.set()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise AbortedError("the client went away before the first token: its turn was dropped at the engine")

    first = await unless_disconnected(queue.get(), request, gone)
    if first[0] == "done" and task.exception() is not None:
        raise task.exception()  # refused before anything was sampled: the route's HTTP error
    head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    return _TurnChunks(store, queue, task, cancelled, head).lines(first, respond, include_usage)


@dataclass
class _TurnChunks:
    """The chunks of a turn under way: its tokens' text as they come (events on ``queue``), then the rest of the
    whole answer with its log-probs, the finish reason, usage if asked and ``[DONE]``."""

    store: SessionStore
    queue: asyncio.Queue
    task: asyncio.Future
    cancelled: Cancellation
    head: dict

    def body(self, delta: dict, finish=None, logprobs=None) -> dict:
        return {**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    def chunk(self, delta: dict, finish=None, logprobs=None) -> str:
        return _sse(self.body(delta, finish, logprobs))

    async def lines(self, event, respond, include_usage: bool):
        text = None
        tokenizer = self.store.renderer.tokenizer
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            while event[0] == "token":
                _, request, token = event
                text = text or IncrementalText(tokenizer, request, {tokenizer.eos_token_id})
                delta = text.push(token)
                if delta:
                    yield self.chunk({"content": delta})
                event = await self.queue.get()
            if self.task.exception() is not None:
                yield _sse(error_body(self.task.exception()))
            else:
                for line in self.ending(respond(self.task.result()), text, include_usage):
                    yield line
            yield "data: [DONE]\n\n"
        finally:
            if not self.task.done():  # the client went away: the engine drops the turn
                self.cancelled.set()

    def ending(self, response: dict, text: IncrementalText | None, include_usage: bool):
        """What the tokens' deltas left of the whole answer, its log-probs, its finish reason and the usage."""
        choice = response["choices"][0]
        content = choice["message"]["content"] or ""
        rest = text.finish(content) if text is not None else content
        if rest or choice["logprobs"]:
            yield self.chunk({"content": rest}, logprobs=choice["logprobs"])
        last = self.body({}, choice["finish_reason"])
        if "meta_info" in choice:
            last["choices"][0]["meta_info"] = choice["meta_info"]
        yield _sse(last)
        if include_usage:
            yield _sse({**self.head, "choices": [], "usage": response["usage"]})
