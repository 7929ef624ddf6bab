"""The engine's KV memory budget: how many key/value positions it may hold at its peak.

``--max-total-tokens`` counts KV token positions, as SGLang's flag of that name counts its token
pool. Keys and values live in a pool of fixed-size blocks (engine/block_pool.py), so what a row
holds is its own length in whole blocks, whatever the other rows' lengths. The peak the budget
bounds is: the blocks held (running rows, cached prefixes), what the running rows may still grow
into, the joining requests' reservations, an admission's prefill (its padded ``[n, L]`` keys and
values before they are written into blocks: ``n L``), and the one layer's gathered keys and values
a decode step attends to (``rows x width / layers``). Admission reserves every request's prompt
plus ``max_new_tokens`` up front, in whole blocks (no retraction: a request once admitted always
finishes), in queue order; a request that does not fit waits until rows leave, cached prefixes
give way first, and one that could never fit, even alone, is refused with the numbers.

The default budget is a share of the memory available when the engine starts: half in ``serve``,
a quarter beside a colocated trainer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError, RequestError

SERVE_SHARE = 0.5  # of MemAvailable at start-up, for serve's engine
COLOCATED_SHARE = 0.25  # beside a trainer in the same process: its weights, optimizer and activations need the rest


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate of what can be allocated without swapping)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def fraction_tokens(fraction: float, before: int, after: int, per_token: int) -> int:
    """SGLang's ``--mem-fraction-static``: the KV pool is what is free once the weights are loaded (``after``)
    less the share of what was free before loading (``before``) that the fraction leaves to the rest of the
    process, ``before x (1 - fraction)`` (SGLang 0.5.23, ``kv_cache_configurator._profile_available_bytes``);
    in positions of ``per_token`` bytes."""
    if not 0 < fraction < 1:
        raise ConfigError(f"mem_fraction_static: must be in (0, 1), got {fraction}")
    pool = after - before * (1 - fraction)
    if pool < per_token:
        raise ConfigError(
            f"mem_fraction_static={fraction}: leaves no KV pool ({after / 2**30:.2f} GiB free after the weights, "
            f"{before * (1 - fraction) / 2**30:.2f} GiB kept for the rest of {before / 2**30:.2f} GiB): give a larger "
            "fraction or --max-total-tokens"
        )
    return int(pool // per_token)


def kv_bytes_per_token(model) -> int:
    """Keys and values of one position over every layer, in the model's dtype."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class KVBudget:
    max_total_tokens: int
    bytes_per_token: int
    layers: int = 1  # a decode step's gathered copy is one layer's: its positions count 1 / layers

    def __post_init__(self):
        if self.max_total_tokens < 1:
            raise ConfigError(f"max_total_tokens: must be >= 1, got {self.max_total_tokens}")

    @classmethod
    def for_model(cls, model, max_total_tokens: int | None = None, share: float = SERVE_SHARE) -> KVBudget:
        per_token = kv_bytes_per_token(model)
        if max_total_tokens is None:
            max_total_tokens = max(1, int(available_bytes() * share) // per_token)
        return cls(int(max_total_tokens), per_token, model.config.num_hidden_layers)

    @property
    def bytes(self) -> int:
        return self.max_total_tokens * self.bytes_per_token

    def attended(self, rows: int, width: int) -> int:
        """Positions of a decode step's gathered keys and values (one layer's, reused by every layer)."""
        return -(-rows * width // self.layers)

    def peak(self, committed: int, needs: list[int], prefill_tokens: int, rows: int, width: int) -> int:
        """Positions at the peak of an admission: what is held and may still grow (``committed``), the
        joining requests' reservations, their prefill, and a decode step's gathered copy."""
        return committed + sum(needs) + prefill_tokens + self.attended(rows, width)

    def check_alone(self, prompt_tokens: int, need: int) -> None:
        """Refuse (400) a request that could not be admitted even into an empty engine (a step attends at
        most its reservation, ``need``, whole blocks)."""
        copy = self.attended(1, need)
        alone = self.peak(0, [need], prompt_tokens, 1, need)
        if alone > self.max_total_tokens:
            raise RequestError(
                f"max_new_tokens: {prompt_tokens} prompt tokens + their reservation of {need} KV positions, the "
                f"prefill's {prompt_tokens} and a decode step's gathered {copy} need {alone} positions, more than "
                f"this engine's --max-total-tokens {self.max_total_tokens} ({self.bytes_per_token} bytes each)"
            )


def column_need(prompt_tokens: int, max_new_tokens: int, page: int) -> int:
    """KV positions a request reserves: its prompt, every new token, the write position, in whole blocks of ``page``."""
    return round_up(prompt_tokens + max_new_tokens + 1, page)


def largest_batch(budget: KVBudget, prompt_tokens: int, max_new_tokens: int, page: int = 1) -> int:
    """How many requests of this shape one admission takes into an empty engine (a GRPO group sent together)."""
    need = column_need(prompt_tokens, max_new_tokens, page)
    n = budget.max_total_tokens // (need + prompt_tokens)
    while n > 0 and budget.peak(0, [need] * n, n * prompt_tokens, n, need) > budget.max_total_tokens:
        n -= 1
    return n
