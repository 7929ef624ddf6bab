"""The rows decoding together and their slot cache: join after a prefill, one decode step's logits,
and the retirement of finished rows (a leaving row's slot takes the last row)."""

from __future__ import annotations

import torch

from .capture import keep_routing
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .running import RunningRequest
from .slot_cache import SlotCache


class RunningBatch:
    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache | None = None, max_total_tokens: int = 0):
        self.runner = runner
        self.rows: list[RunningRequest] = []
        self.cache: SlotCache | None = None
        self.prefix_cache = prefix_cache  # finished rows leave their keys and values there (engine/prefix_cache.py)
        self.max_total_tokens = max_total_tokens

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def held(self) -> tuple[int, int]:
        """``(slots, capacity)`` the cache holds now (engine/kv_budget.py plans from it)."""
        return (self.cache.slots, self.cache.capacity) if self.cache is not None else (0, 0)

    def join(self, group: list[RunningRequest], cache: SlotCache) -> None:
        """A prefilled group joins: every row's reservation at once, in the shape admission counted,
        so the cache never grows while it decodes."""
        need = max(s.need for s in self.rows + group)
        if self.cache is not None:
            self.cache.reserve(self.cache.size + len(group), need, cache.layers[0].k)
        self.cache = self.runner.merge(self.cache, cache)
        self.cache.reserve(self.cache.size, need, cache.layers[0].k)
        self.rows.extend(group)

    def decode(self) -> torch.Tensor:
        """The next-token logits of every row, each fed its last token at its position."""
        last = torch.tensor([s.output_ids[-1] for s in self.rows])
        positions = torch.tensor([s.position for s in self.rows])
        routing = any(s.request.return_routed_experts for s in self.rows)
        logits = self.runner.decode(self.cache, last, positions, routing=routing)
        if routing:
            keep_routing(self.rows, self.runner.routing_rows)
        for s in self.rows:
            s.position += 1
        return logits

    def retire(self) -> list[RunningRequest]:
        """Take the finished rows out (their slots free) and return them."""
        keep = [i for i, s in enumerate(self.rows) if s.finish_reason is None]
        if len(keep) == len(self.rows):
            return []
        done = [s for s in self.rows if s.finish_reason is not None]
        if self.prefix_cache is not None and self.prefix_cache.enabled:
            self._keep_prefixes()
        self.cache, order = self.runner.keep(self.cache, keep)
        self.rows = [self.rows[i] for i in order]
        if self.cache is not None:  # the rows that needed the most room may have left: hold what the rest reserved
            self.cache.shrink(max(s.need for s in self.rows))
        return done

    def _keep_prefixes(self) -> None:
        """Every finished row's keys and values (prompt and fed outputs) into the prefix cache, within the
        room the KV budget leaves beside the slot cache."""
        slots, capacity = self.held
        for row, seq in enumerate(self.rows):
            if seq.finish_reason is None or seq.failure is not None:
                continue
            length = int(self.cache.lengths[row])
            ids = (list(seq.request.input_ids) + seq.output_ids)[:length]
            layers = [
                (layer.k[row, :, :length].clone(), layer.v[row, :, :length].clone()) for layer in self.cache.layers
            ]
            self.prefix_cache.store(ids, layers, self.max_total_tokens - slots * capacity)

    def clear(self) -> list[RunningRequest]:
        """Every row out at once (a step of the whole batch failed); the cache is dropped."""
        rows, self.rows, self.cache = self.rows, [], None
        return rows
