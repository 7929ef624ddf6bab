"""The engine's KV memory budget: how many key/value positions it may hold at its peak.

``--max-total-tokens`` counts KV token positions, as SGLang's flag of that name counts its token
pool. Our slot cache is a rectangle, ``slots x capacity`` positions per layer (engine/slot_cache.py),
so what the budget bounds is that rectangle at its peak: the buffers held, the new ones while a
grown cache is copied into them, and an admission's prefill (its padded ``[n, L]`` keys and values
and the group's own cache before it joins: ``2 n L``). Admission reserves every request's prompt
plus ``max_new_tokens`` up front (no retraction: a request once admitted always finishes), in queue
order; a request that does not fit waits until rows leave, and one that could never fit, even
alone, is refused with the numbers. The rectangle is the price of the cache's decode speed: one
long row makes every slot that long, so long and short requests share the budget unevenly (a block
pool with paged attention would not; docs/engines.md says why it is not built yet).

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


def plan_shape(
    held: tuple[int, int], rows: int, columns: int, max_rows: int, max_tokens: int | None
) -> tuple[int, int]:
    """The ``(slots, capacity)`` the cache grows to for ``rows`` rows of ``columns`` positions, from
    ``held``: the dimension that ran out doubles (slots up to ``max_rows``), unless the copy's peak
    (held plus new) would pass ``max_tokens``, in which case it grows only as far as needed."""
    slots, capacity = held
    if rows <= slots and columns <= capacity:
        return held
    doubled = (
        slots if rows <= slots else min(max(rows, 2 * slots), max(rows, max_rows)),
        capacity if columns <= capacity else max(columns, 2 * capacity),
    )
    if max_tokens is None:
        return doubled
    exact = (max(rows, slots), max(columns, capacity))
    for shape in (doubled, (exact[0], doubled[1]), (doubled[0], exact[1]), exact):
        if slots * capacity + shape[0] * shape[1] <= max_tokens:
            return shape
    return exact


@dataclass(frozen=True)
class KVBudget:
    max_total_tokens: int
    bytes_per_token: int

    def __post_init__(self):
        if self.max_total_tokens < 1:
            raise ConfigError(f"max_total_tokens: must be >= 1, got {self.max_total_tokens}")

    @classmethod
    def for_model(cls, model, max_total_tokens: int | None = None, share: float = SERVE_SHARE) -> KVBudget:
        per_token = kv_bytes_per_token(model)
        if max_total_tokens is None:
            max_total_tokens = max(1, int(available_bytes() * share) // per_token)
        return cls(int(max_total_tokens), per_token)

    @property
    def bytes(self) -> int:
        return self.max_total_tokens * self.bytes_per_token

    def peak(self, held: tuple[int, int], shape: tuple[int, int], prefill_rows: int, prefill_length: int) -> int:
        """Positions at the peak of an admission: held buffers, the grown ones while copied, the prefill."""
        grown = shape[0] * shape[1] if shape != held else 0
        return held[0] * held[1] + grown + 2 * prefill_rows * prefill_length

    def check_alone(self, prompt_tokens: int, need: int) -> None:
        """Refuse (400) a request that could not be admitted even into an empty engine."""
        alone = self.peak((0, 0), (1, need), 1, prompt_tokens)
        if alone > self.max_total_tokens:
            raise RequestError(
                f"max_new_tokens: {prompt_tokens} prompt tokens + their reservation of {need} KV positions and the "
                "prefill's "
                f"{2 * prompt_tokens} need {alone} positions, more than this engine's --max-total-tokens "
                f"{self.max_total_tokens} "
                f"({self.bytes_per_token} bytes each)"
            )


def column_need(prompt_tokens: int, max_new_tokens: int, align: int) -> int:
    """Cache columns a request may fill: its prompt, every new token, the write column, rounded up to ``align``."""
    return -(-(prompt_tokens + max_new_tokens + 1) // align) * align


def largest_batch(budget: KVBudget, prompt_tokens: int, max_new_tokens: int, align: int = 1) -> int:
    """How many requests of this shape one admission takes into an empty engine (a GRPO group sent together)."""
    need = column_need(prompt_tokens, max_new_tokens, align)
    return budget.max_total_tokens // (need + 2 * prompt_tokens)
