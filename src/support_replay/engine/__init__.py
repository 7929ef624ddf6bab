"""The embedded inference engine: a Hugging Face model, batched decoding with a KV cache,
continuous batching, sampling through the replay core. Its HTTP server lives in ``serving/``.

``Engine`` (which loads transformers) is imported on first use, so ``engine.limits`` stays light.
"""

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
