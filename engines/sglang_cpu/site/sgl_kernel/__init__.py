"""The ``sgl_kernel`` SGLang imports on its CPU path, for a CPU torch (``make sglang``).

SGLang's own kernel package (``sglang-kernel``) is a CUDA build. On the path support-replay runs (``--device cpu
--attention-backend torch_native --sampling-backend pytorch``, no speculative decoding, no seeded sampling) SGLang
imports a few names from it at start-up (``assign_req_to_token_pool_cpu`` in ``srt/mem_cache/allocation.py``, the
speculative-decoding ones in ``srt/speculative/``) and calls none: every name is here as a function that raises,
naming the op, if SGLang ever calls it. ``torch.ops.sgl_kernel`` is left unregistered, so SGLang's
``cpu_has_amx_support()`` is false and every layer takes its native torch path. An op SGLang is seen to call gets
written here from SGLang's own reference for it, with a test against that reference; none has been.
"""

from __future__ import annotations


class NotProvided(NotImplementedError):
    """SGLang called an ``sgl_kernel`` op this CPU package does not implement."""


def _not_provided(name: str):
    def op(*args, **kwargs):
        raise NotProvided(
            f"sgl_kernel.{name}: SGLang called an op support-replay's CPU sgl_kernel does not provide "
            "(engines/sglang_cpu/site/sgl_kernel); the path that called it (speculative decoding, seeded sampling, "
            "an AMX kernel) is not one support-replay runs SGLang on"
        )

    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("_"):  # module attributes Python and importlib probe for
        raise AttributeError(name)
    return _not_provided(name)
