"""The grammar mask against llguidance's own matcher: every id the mask leaves is one the grammar accepts
next, every id it removes one it refuses; rows without a grammar are untouched."""

import pytest
import torch
from transformers import AutoTokenizer

from support_replay.engine.grammar import Grammars
from support_replay.serving.structured_outputs import json_schema_grammar


@pytest.mark.float_bits
def test_the_mask_is_what_the_grammar_accepts_next(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    vocab = len(tok)
    grammars = Grammars(tok, vocab, {tok.eos_token_id})
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = json_schema_grammar(schema, "test")
    grammars.check(grammar)
    matcher = grammars.matcher(grammar)
    prefix = tok('{"n": 1', add_special_tokens=False)["input_ids"]
    for t in prefix:
        grammars.advance(matcher, t)
    logits = torch.randn(2, vocab)
    masked = grammars.mask([None, matcher], logits)
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    for t in range(vocab):
        probe = matcher.deep_copy()
        assert (probe.try_consume_tokens([t]) == 1) == (t in allowed), (t, tok.decode([t]))
