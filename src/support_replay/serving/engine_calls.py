"""What every route of the engine server does with the engine: submit and wait (dropping the
requests when the client goes away), tokenize a prompt, and shape SGLang's ``meta_info``."""

from __future__ import annotations

import asyncio

from fastapi import Request

from ..engine import Engine
from ..errors import EngineError, SupportReplayError
from ..protocol import Completion, GenerateRequest
from ..rollout.text_bound import TextBound
from .disconnects import unless_disconnected
from .sglang_format import ResponseForm, check_json_bound, check_json_capture, meta_info
from .token_stream import IncrementalText, TokenStream


class EngineCalls:
    def __init__(self, engine: Engine, bound: TextBound | None = None):
        self.engine = engine
        self.bound = bound or TextBound()  # prompt text that cannot fit is refused before it is tokenized

    async def prepare(self, requests: list[GenerateRequest]) -> None:
        """Compile the body's new grammars off the event loop and the engine's thread (engine/grammar.py), so
        that submitting finds them compiled."""
        self.engine.limits.check_body(requests)
        grammars = [r.grammar for r in requests if r.grammar is not None]
        if grammars:
            await self.engine.grammars.prepare(grammars)

    async def run(self, requests: list[GenerateRequest], http_request: Request) -> list[Completion]:
        """Submit, wait, and drop the requests from the engine if the client goes away meanwhile."""
        engine = self.engine
        await self.prepare(requests)
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

    def token_stream(self, requests: list[GenerateRequest]) -> TokenStream:
        """Submit ``requests`` with a token callback each (call on the event loop)."""
        return TokenStream(self.engine, requests)

    def incremental_text(self, request: GenerateRequest) -> IncrementalText:
        return IncrementalText(self.engine.tokenizer, request, self.engine.eos_ids)

    def tokenize(self, text: str) -> list[int]:
        self.bound.check(text, "text")
        return self.engine.tokenizer(text)["input_ids"]

    def check_json_bound(self, requests: list[GenerateRequest], form: ResponseForm) -> None:
        """400 before the body runs when its top-k bounded capture could not be answered as JSON lists."""
        check_json_bound(requests, form, self.engine.vocab_size, self.engine.limits.max_json_capture_bytes)

    def check_json(self, requests: list[GenerateRequest], completions: list[Completion], form: ResponseForm) -> None:
        """400 before an answer's ``meta_info`` is built when its capture would be too large as JSON lists."""
        limit = self.engine.limits.max_json_capture_bytes
        check_json_capture(zip(requests, completions), form, self.engine.vocab_size, limit)

    def meta_info(self, completion: Completion, request: GenerateRequest, form: ResponseForm) -> dict:
        self.check_json([request], [completion], form)  # a streamed answer's last chunk, one completion at a time
        routing = self.engine.runner.routing
        experts = routing.shape.num_experts if routing is not None else 0
        return meta_info(completion, request, form=form, vocab_size=self.engine.vocab_size, num_experts=experts)
