"""The embedded inference engine: a Hugging Face model, batched decoding with a KV cache,
continuous batching, sampling through the replay core, and an SGLang/OpenAI-compatible server."""

from .requests import CapacityError, EngineError, GenerateRequest, GenerationResult, RequestError
from .scheduler import Engine

__all__ = ["CapacityError", "Engine", "EngineError", "GenerateRequest", "GenerationResult", "RequestError"]
