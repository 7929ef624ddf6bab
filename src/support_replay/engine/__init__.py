"""The embedded inference engine: a Hugging Face model, batched decoding with a KV cache,
continuous batching, sampling through the replay core. Its HTTP server lives in ``serving/``."""

from .engine import Engine

__all__ = ["Engine"]
