"""Text refused before it is rendered or tokenized when it cannot fit the prompt limit.

A token spells at most ``longest`` characters of its vocabulary (a byte-level BPE key has one character
per byte, and a character takes at least one byte), so a text of C characters is at least C / longest
tokens. Twice that bound (a normaliser may compose characters) is refused at once: a 7 MB chat message
was rendered and tokenized on the event loop for 10 s before its 400 (docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RequestError


def longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token (special and added tokens included)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def text_chars(value) -> int:
    """Characters of every string inside ``value`` (messages, tools: dicts and lists of them)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


@dataclass(frozen=True)
class TextBound:
    max_prompt_tokens: int | None = None
    longest: int = 1

    @classmethod
    def of(cls, tokenizer, max_prompt_tokens: int) -> TextBound:
        return cls(max_prompt_tokens, longest_token_chars(tokenizer))

    @property
    def max_chars(self) -> int | None:
        return None if self.max_prompt_tokens is None else 2 * self.max_prompt_tokens * self.longest

    def check(self, value, field: str) -> None:
        """400 naming ``field`` when ``value``'s text cannot fit the prompt limit, before any work on it."""
        limit = self.max_chars
        if limit is None:
            return
        chars = text_chars(value)
        if chars > limit:
            raise RequestError(
                f"{field}: {chars:,} characters cannot fit the limit of {self.max_prompt_tokens:,} prompt tokens (a "
                f"token spells at most {self.longest} characters; refused before tokenizing above {limit:,})"
            )
