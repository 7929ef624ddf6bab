"""One client interface over every rollout engine: ``generate(requests) -> list[Completion]``.

- ``EngineBackend``: the in-process engine (imports the engine and the model code).
- ``SGLangBackend``: SGLang >= 0.5.20 over HTTP, and equally our own server or router.
- ``VLLMBackend``: vLLM over HTTP (native ``sampling_mask`` or ``processed_logprobs``).

Each backend parses its engine's payload and validates every response once
(``protocol.validate_completion``) before handing it back. The HTTP backends import
neither the engine nor transformers; ``EngineBackend`` is loaded on first use.
"""

from .base import Backend

__all__ = ["Backend", "EngineBackend", "SGLangBackend", "VLLMBackend"]


def __getattr__(name: str):
    if name == "EngineBackend":
        from .local import EngineBackend

        return EngineBackend
    if name == "SGLangBackend":
        from .sglang import SGLangBackend

        return SGLangBackend
    if name == "VLLMBackend":
        from .vllm import VLLMBackend

        return VLLMBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
