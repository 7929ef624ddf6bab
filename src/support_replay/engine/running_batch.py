"""The rows decoding together and their block tables: join after a prefill, one decode step's logits,
and the retirement of finished rows (their blocks go back to the pool, or to the prefix cache)."""

from __future__ import annotations

import numpy as np
import torch

from .capture import keep_routing
from .model_runner import ModelRunner
from .paged_cache import PagedCache
from .prefix_cache import PrefixCache
from .running import RunningRequest


class RunningBatch:
    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache | None = None):
        self.runner = runner
        self.rows: list[RunningRequest] = []
        self.cache: PagedCache | None = None
        self.prefix_cache = prefix_cache  # finished rows leave their blocks there (engine/prefix_cache.py)

    def __len__(self) -> int:
        return len(self.rows)

    def committed(self) -> int:
        """KV positions the pool holds (running rows, cached prefixes) plus what the running rows may
        still grow into within their reservations (engine/kv_budget.py)."""
        pool = self.runner.pool
        page = pool.block_size
        tables = self.cache.tables if self.cache is not None else []
        growth = sum(max(0, s.need // page - len(t)) for s, t in zip(self.rows, tables))
        return (pool.used + growth) * page

    def join(self, group: list[RunningRequest], cache: PagedCache) -> None:
        """A prefilled group joins (its blocks are already in the pool: nothing is copied)."""
        self.cache = self.runner.merge(self.cache, cache)
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

    def captured_ids(self) -> int:
        """Support ids the running rows hold captured."""
        return sum(s.captured for s in self.rows)

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
        return done

    def _keep_prefixes(self) -> None:
        """Every finished row's blocks (prompt and fed outputs) pass to the prefix cache."""
        for row, seq in enumerate(self.rows):
            if seq.finish_reason is None or seq.failure is not None:
                continue
            length = int(self.cache.lengths[row])
            ids = (list(seq.request.input_ids) + seq.output_ids)[:length]
            routing = np.concatenate(seq.routing)[:length] if seq.request.return_routed_experts else None
            if routing is not None and len(routing) != length:
                routing = None  # not every fed position's experts were kept
            self.prefix_cache.store(ids, self.cache.row_blocks(row), routing, seq.epoch)

    def clear(self) -> list[RunningRequest]:
        """Every row out at once (a step of the whole batch failed); their blocks go back."""
        rows, self.rows = self.rows, []
        if self.cache is not None:
            self.cache.release()
        self.cache = None
        return rows
