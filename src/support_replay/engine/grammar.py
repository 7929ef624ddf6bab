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

import numpy as np
import torch

from ..errors import RequestError


class Grammars:
    """The engine's grammar compiler: one llguidance tokenizer, a matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll = None  # built on the first grammar: most engines never see one

    @property
    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._ll

    def check(self, grammar: str) -> None:
        """Refuse (400) a grammar llguidance cannot compile against this tokenizer."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise RequestError(f"grammar: {error}")

    def matcher(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise RequestError(f"grammar: {matcher.get_error()}")
        return matcher

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
