"""Tokens as the engine samples them, on the event loop, and the text each one adds (real streaming).

The engine calls back on its own thread with every sampled token; the callbacks hop to the event
loop, where a route turns them into SSE chunks. A text delta is held back while it may still
change: an incomplete UTF-8 character, the tail that could begin a stop string (vLLM's stop
buffer), a stop token (its text is left out of the answer). The answer's final text, once the
request is done, supplies the rest, so the streamed deltas concatenate to exactly the whole answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future

from ..engine.stopping import decode_increment
from ..protocol import GenerateRequest

log = logging.getLogger(__name__)


class TokenStream:
    """``events()`` yields ``("token", i, id)`` as request ``i`` samples and ``("done", i, future)`` when it ends."""

    def __init__(self, engine, requests: list[GenerateRequest]):
        loop = asyncio.get_running_loop()
        self.engine, self.queue = engine, asyncio.Queue()

        def on_token(i: int):
            return lambda token: loop.call_soon_threadsafe(self.queue.put_nowait, ("token", i, token))

        self.futures: list[Future] = engine.submit_all(requests, [on_token(i) for i in range(len(requests))])
        for i, future in enumerate(self.futures):
            future.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(self.queue.put_nowait, ("done", i, f)))

    def refused(self) -> BaseException | None:
        """The error of a request the engine refused at once (before any chunk is sent: a plain 4xx)."""
        for future in self.futures:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    async def events(self) -> AsyncIterator[tuple]:
        left = len(self.futures)
        while left:
            event = await self.queue.get()
            left -= event[0] == "done"
            yield event

    def abort(self) -> None:
        """The client went away (or the stream ended early): the engine drops what still runs."""
        for future in self.futures:
            if not future.done():
                self.engine.abort(future)


class IncrementalText:
    """The text one request's tokens add, chunk by chunk, decoded as the engine's stop check decodes it: a few
    tokens per step (``stopping.decode_increment``), not the whole output again at every token."""

    def __init__(self, tokenizer, request: GenerateRequest, eos_ids: set[int]):
        self.tokenizer, self.request = tokenizer, request
        self.stop_tokens = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_ids))
        self.hold = max(map(len, request.stop), default=1) - 1  # a stop string's first characters may be here
        self.ids: list[int] = []
        self.decoded, self.decode_from = "", (0, 0)
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        if token in self.stop_tokens and len(self.ids) > self.request.min_new_tokens:
            return ""  # it may end the answer, and the answer leaves its text out: the end says
        step = decode_increment(self.tokenizer, self.ids, self.decode_from, self.request.skip_special_tokens)
        if step is None:
            return ""
        new, self.decode_from = step
        self.decoded += new
        text = self.decoded
        if text.endswith("\ufffd"):  # a character still being spelled byte by byte
            return ""
        safe = text[: len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the answer once it is done."""
        if not final_text.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the answer %r", self.sent[-40:], final_text[-40:])
            return ""
        rest, self.sent = final_text[len(self.sent) :], final_text
        return rest
