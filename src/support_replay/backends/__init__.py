"""One client interface over every rollout engine: ``generate(requests) -> list[Completion]``.

- ``EngineBackend``: the in-process engine.
- ``SGLangBackend``: SGLang >= 0.5.20 over HTTP, and equally our own server or router.
- ``VLLMBackend``: vLLM over HTTP (native ``sampling_mask`` or ``processed_logprobs``).

Every backend validates what it received (SPEC section 3) before handing it back.
"""

from .base import Backend, Completion, validate_completion
from .local import EngineBackend
from .sglang import SGLangBackend
from .vllm import VLLMBackend

__all__ = ["Backend", "Completion", "EngineBackend", "SGLangBackend", "VLLMBackend", "validate_completion"]
