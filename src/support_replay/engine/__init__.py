"""The embedded inference engine: a Hugging Face model, batched decoding with a KV cache,
continuous batching, sampling through the replay core. Its HTTP server lives in ``serving/``.

``Engine`` (which loads transformers) and ``EngineSettings`` are imported on first use, so ``engine.limits``
stays light.
"""

__all__ = ["Engine", "EngineSettings"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "EngineSettings":
        from .settings import EngineSettings

        return EngineSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
