"""Stop conditions: EOS, stop tokens, stop strings (decoded incrementally) and the token budget; the
output's text as vLLM and SGLang give it (the matched stop string or token left out unless asked)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # running.py decodes its answer with output_text below
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
            if new and len(seq.output_ids) > req.min_new_tokens:  # vLLM: no stop string ends the first min_tokens
                # a stop string not seen before ends in the new text: search only there
                start = max(0, len(seq.decoded) - new - max(map(len, req.stop)) + 1)
                window = seq.decoded[start:]
                hits = [(window.find(s), s) for s in req.stop if s and s in window]
                if hits:
                    pos, matched = min(hits)
                    kept = len(matched) if req.include_stop_str_in_output else 0
                    seq.text = seq.decoded[: start + pos + kept]
                    seq.finish_reason = {"type": "stop", "matched": matched}
        if seq.finish_reason is None and len(seq.output_ids) >= req.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}

    def _decode_new_text(self, seq: RunningRequest) -> int:
        """Append the text the newest tokens add to ``seq.decoded``; returns how many characters."""
        step = decode_increment(self.tokenizer, seq.output_ids, seq.decode_from, seq.request.skip_special_tokens)
        if step is None:
            return 0
        new, seq.decode_from = step
        seq.decoded += new
        return len(new)


def decode_increment(tokenizer, ids: list[int], decode_from: tuple[int, int], skip: bool):
    """``(the text the newest of ids add, the next offsets)``, or None while a token may end inside a UTF-8
    character (up to 4 tokens: a longer invalid run is final). Decodes a few tokens per step, not the whole
    output (vLLM's incremental rule: the text of ``ids[prefix:]`` past that of ``ids[prefix:read]``, so a
    tokenizer's treatment of a leading space cancels out)."""
    prefix, read = decode_from
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
    text = tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
    if text.endswith("\ufffd") and len(ids) - read < UTF8_MAX_BYTES:  # an incomplete character may still end
        return None
    return text[len(before) :], (read, len(ids))


def output_text(tokenizer, output_ids: list[int], request, finish_reason: dict) -> str:
    """The text of an output that did not end on a stop string: a matched stop token (EOS or one of
    ``stop_token_ids``) is left out unless ``include_stop_str_in_output`` (vLLM's detokenizer, SGLang's
    ``no_stop_trim``); ``skip_special_tokens`` and ``spaces_between_special_tokens`` go to the tokenizer."""
    ids = output_ids
    stopped_on_token = finish_reason.get("type") == "stop" and isinstance(finish_reason.get("matched"), int)
    if stopped_on_token and not request.include_stop_str_in_output:
        ids = ids[:-1]
    spacing = {} if request.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens, **spacing)
