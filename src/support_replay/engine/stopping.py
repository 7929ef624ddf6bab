"""Stop conditions: EOS, stop tokens, stop strings (decoded incrementally) and the token budget."""

from __future__ import annotations

from .running import RunningRequest

UTF8_MAX_BYTES = 4  # a character is at most 4 bytes: a byte-level token run longer than that never completes one


def eos_ids(model, tokenizer) -> set[int]:
    """Every EOS id the model's generation config, its config and its tokenizer name."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class StopConditions:
    """``check(seq, token)`` sets ``seq.finish_reason`` once the request is done."""

    def __init__(self, tokenizer, eos: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos

    def check(self, seq: RunningRequest, token: int) -> None:
        req = seq.request
        if (not req.ignore_eos and token in self.eos_ids) or token in req.stop_token_ids:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif req.stop:
            new = self._decode_new_text(seq)
            if new:  # a stop string not seen before ends in the new text: search only there
                start = max(0, len(seq.decoded) - new - max(map(len, req.stop)) + 1)
                window = seq.decoded[start:]
                hits = [(window.find(s), s) for s in req.stop if s and s in window]
                if hits:
                    pos, matched = min(hits)
                    seq.text = seq.decoded[: start + pos]
                    seq.finish_reason = {"type": "stop", "matched": matched}
        if seq.finish_reason is None and len(seq.output_ids) >= req.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}

    def _decode_new_text(self, seq: RunningRequest) -> int:
        """Append the text the newest tokens add to ``seq.decoded``; returns how many characters.
        Decodes a few tokens per step (vLLM's incremental rule: the text of ``[prefix:]`` past that of
        ``[prefix:read]``), not the whole output, and waits while a token may end inside a UTF-8
        character (up to 4 tokens: a longer invalid run is final)."""
        prefix, read = seq.decode_from
        ids = seq.output_ids
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd") and len(ids) - read < UTF8_MAX_BYTES:  # an incomplete character may still end
            return 0
        new = text[len(before) :]
        seq.decoded += new
        seq.decode_from = (read, len(ids))
        return len(new)
