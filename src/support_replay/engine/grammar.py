"""Grammar-constrained sampling (structured outputs) with llguidance, vLLM's ``guidance`` backend.

A request's grammar (llguidance's serialized form: JSON schema, regex, Lark; ``serving/structured_outputs.py``
builds it from ``response_format``, forced tool calls, vLLM's ``structured_outputs`` and SGLang's fields)
gets a matcher when the request is admitted. Every step, the ids the grammar forbids go to -inf
*before* the sampling filters, like the min-tokens mask: the captured support then holds only
allowed ids, so the trainer's support score replays the constrained policy with nothing new. Once
the grammar is complete the matcher allows EOS alone.

llguidance rather than xgrammar: the same JSON-schema/regex/Lark coverage and vLLM's second
backend, as a self-contained Rust wheel (xgrammar pulls triton and apache-tvm-ffi into a CPU install).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from ..errors import RequestError
from .grammar_check import GrammarChecker, first_line, tokenizer_json


class Grammars:
    """The engine's grammar compiler: one llguidance tokenizer, one compiled matcher per distinct grammar (an LRU
    of ``cached``), a copy of it per constrained request. The server compiles a body's new grammars before it
    submits them (``prepare``: first in the killable worker process under its deadline, then here in a worker
    thread, llguidance dropping the GIL), so neither the event loop nor the engine's thread compiles."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_ids: set[int],
        *,
        cached: int = 64,
        seconds: float = 5.0,
        waiting: int = 16,
    ):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self.cached, self.seconds, self.waiting = cached, seconds, waiting
        self._ll = None  # built on the first grammar: most engines never see one
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> matcher in its initial state
        self._lock = threading.Lock()
        self._held = weakref.WeakKeyDictionary()  # a submitted request's future -> its compiled matcher
        self._checker: GrammarChecker | None = None
        self._compiling: dict[str, asyncio.Future] = {}  # grammars being prepared (on the event loop)

    @property
    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance

            # from the same tokenizer.json text the worker process builds its own from (grammar_check.py)
            self._ll = llguidance.LLTokenizer(
                tokenizer_json(self.tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._ll

    @property
    def checker(self) -> GrammarChecker:
        if self._checker is None:
            self._checker = GrammarChecker(self.tokenizer, self.vocab_size, self.eos_ids, self.seconds, self.waiting)
        return self._checker

    def _lookup(self, grammar: str):
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
            return template

    def _keep(self, grammar: str, template) -> None:
        with self._lock:
            self._compiled[grammar] = template
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > self.cached:
                self._compiled.popitem(last=False)

    def _build(self, grammar: str):
        """Build ``grammar``'s matcher here (the caller's thread; llguidance drops the GIL meanwhile)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"grammar: {first_line(matcher.get_error())}")
        return matcher

    def compiled(self, grammar: str):
        """``grammar``'s matcher in its initial state, built on this thread unless cached (callers in the
        engine's process, such as a trainer's own engine; the server has prepared its grammars)."""
        template = self._lookup(grammar)
        if template is None:
            template = self._build(grammar)
            self._keep(grammar, template)
        return template

    def check(self, grammar: str) -> None:
        """Refuse (400) a grammar llguidance cannot build a matcher of against this tokenizer."""
        self.compiled(grammar)

    def hold(self, future, grammar: str) -> None:
        """Keep ``grammar``'s compiled matcher for the request of ``future`` until it is admitted (an eviction
        from the LRU meanwhile must not make the engine's thread compile it again)."""
        self._held[future] = self.compiled(grammar)

    def matcher(self, grammar: str, future=None):
        """A fresh matcher of ``grammar`` for one request (a copy of the compiled one: microseconds)."""
        template = self._held.pop(future, None) if future is not None else None
        return (template or self.compiled(grammar)).deep_copy()

    async def prepare(self, grammars: list[str]) -> None:
        """Compile the grammars not cached yet, each once however many requests carry it: first in the
        killable worker process under the deadline (400 with the first line of the error, or the deadline; 503
        when too many wait), then in this process off the event loop."""
        for grammar in dict.fromkeys(grammars):
            if self._lookup(grammar) is not None:
                continue
            pending = self._compiling.get(grammar)
            if pending is None:
                pending = asyncio.ensure_future(self._prepare_one(grammar))
                self._compiling[grammar] = pending
                pending.add_done_callback(lambda task, g=grammar: self._settled(g, task))
            await asyncio.shield(pending)  # a client that leaves does not cancel a compile others wait on

    def _settled(self, grammar: str, task: asyncio.Future) -> None:
        self._compiling.pop(grammar, None)
        if not task.cancelled():
            task.exception()  # retrieved: a compile whose only client left raises nowhere

    async def _prepare_one(self, grammar: str) -> None:
        await asyncio.to_thread(self.checker.check, grammar)
        template = await asyncio.to_thread(self._build, grammar)
        self._keep(grammar, template)

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()

    def mask(self, matchers: list, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every id a row's matcher forbids at -inf (rows with no matcher untouched)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        vocab = logits.shape[1]
        bits = [np.unpackbits(np.frombuffer(matchers[i].compute_bitmask(), np.uint8), bitorder="little") for i in rows]
        allowed = torch.from_numpy(np.stack(bits)[:, :vocab].astype(bool))
        out = logits.clone()
        index = torch.tensor(rows)
        out[index] = out[index].masked_fill(~allowed.to(out.device), float("-inf"))
        return out

    @staticmethod
    def advance(matcher, token: int) -> None:
        """Feed the sampled token; a token the grammar refuses (it was allowed by the mask) is an engine error."""
        if matcher.is_stopped():
            return
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused sampled token {token}: {matcher.get_error()}")
