"""What an engine is built with, as one record: ``Engine(model, tokenizer, settings)``.

``serve`` generates its engine flags from these fields (their ``help`` and ``flags``), the trainer's
in-process engine and the benchmarks build the same record, so the three agree by construction.
The per-request bounds are their own record (``limits.py``), a field of this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core.sampling import SEMANTICS
from ..modeling.decode_attention import CHOICES as DECODE_ATTENTION_CHOICES
from ..modeling.decode_attention import HELP as DECODE_ATTENTION_HELP
from ..modeling.linear_kernels import KERNELS, LINEAR_KERNEL_HELP
from ..protocol import DEFAULT_SAMPLING_MASK_MAX_TOKENS, DEFAULT_WEIGHT_VERSION
from .kv_budget import SERVE_SHARE
from .limits import EngineLimits


def _setting(default, help: str, *, flag: bool = True, **flag_says):
    """A field with what its ``serve`` flag says (``record_flags.py``): ``flags`` (SGLang's names), ``choices``,
    ``type``, ``off``; ``flag=False`` for one set another way."""
    return field(default=default, metadata={"help": help, "flag": flag, **flag_says})


@dataclass(frozen=True)
class EngineSettings:
    semantics: str = _setting("sglang", "filter semantics of the sampler", choices=SEMANTICS)
    sampling_mask_max_tokens: int = _setting(DEFAULT_SAMPLING_MASK_MAX_TOKENS, "largest support a request may capture")
    seed: int = _setting(0, "seeds requests that bring no seed of their own")
    device: str = _setting("cpu", "the device the model runs on")
    deterministic: bool = _setting(
        False,
        "batch-invariant forward: a sequence's logits do not depend on its batch (true-on-policy; SGLang's "
        "--enable-deterministic-inference)",
        flags=("--enable-deterministic-inference",),
    )
    weight_version: str = _setting(DEFAULT_WEIGHT_VERSION, "the name of the weights it starts with", flag=False)
    linear_kernel: str = _setting("auto", LINEAR_KERNEL_HELP, choices=KERNELS)
    decode_attention: str = _setting("auto", DECODE_ATTENTION_HELP, choices=DECODE_ATTENTION_CHOICES)
    max_total_tokens: int | None = _setting(
        None,
        "KV positions the engine may hold at its peak, as SGLang's flag counts them; a request waits until it fits "
        "(default: half the memory available at start)",
        type=int,
    )
    kv_share: float = _setting(SERVE_SHARE, "share of the memory available at start for the KV cache", flag=False)
    prefix_cache: bool = _setting(
        True,
        "keep no finished sequences' keys and values for later prompts (the prefix cache; SGLang's flag)",
        off="--disable-radix-cache",
    )
    decode_log_interval: int = _setting(
        0, "log SGLang's decode line (running requests, KV use, throughput, queue) every N decode steps (0: off)"
    )
    page_size: int = _setting(
        16,
        "KV positions per block of the engine's pool (SGLang's flag; vLLM's --block-size): a row holds its own length "
        "in whole blocks, and a prefix is shared by whole blocks",
    )
    limits: EngineLimits = _setting(EngineLimits(), "what one request and the queue may hold", flag=False)

    def but(self, **changes) -> EngineSettings:
        return replace(self, **changes)
