"""One string that names what a tokenizer does to a model's inputs: its token map and its chat template. Two
models that must read the same ids (a distillation teacher and its student) compare it."""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the token map (every token and its id) and the chat template."""
    body = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.chat_template], ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()
