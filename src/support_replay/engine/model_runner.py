"""Batched prefill and decode of a Hugging Face causal LM over the engine's block pool.

New sequences are prefilled together, left-padded to a common length, with Hugging Face's
dynamic cache (identical prompts admitted together are prefilled once and their rows copied);
the 2-D attention mask hides the padding and explicit position ids keep every sequence's
positions its own. Their keys and values are then written into their blocks of the pool
(engine/block_pool.py, engine/paged_cache.py), and every decode step writes one position per row
in place and attends to the rows' blocks gathered into one view (continuous batching: sequences
join and leave between decode steps, copying nothing). For Llama and Qwen3 models the decode
step is one function over the cache (engine/fused_step.py; on oneDNN over packed weights), the
same bits as the module tree. A mixture-of-experts model decodes through its modules, with the
sparse blocks of modeling/moe.py; when some running request asks for its routing, the forward
records every layer's top-k experts (``routing_rows``: one row per prompt position after a prefill,
one per sequence after a decode step).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..errors import EngineError
from ..modeling.moe import install_routing
from .block_pool import BlockPool
from .fused_step import FusedDecoder, unsupported
from .paged_cache import PagedCache
from .prefix_cache import Entry

log = logging.getLogger(__name__)


def load_model_and_tokenizer(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    path = Path(path)
    if not (path / "config.json").exists():
        raise EngineError(f"hf_checkpoint: {path} has no config.json (a Hugging Face checkpoint directory is expected)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


class ModelRunner:
    def __init__(self, model, device: str = "cpu", pool: BlockPool | None = None):
        self.model = model
        self.device = device
        # every row's keys and values (engine/block_pool.py); unbounded but for the engine's budget
        self.pool = pool or BlockPool(model.config.num_hidden_layers, 16, 1 << 24)
        params = inspect.signature(model.forward).parameters
        # transformers 5 calls the cache argument `cache`; earlier releases `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.share_prompts = True  # identical prompts admitted together prefill once
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(model.config, "use_sliding_window", False):
            raise EngineError(
                f"model: layer types {sorted(layer_types)} (sliding window: "
                f"{getattr(model.config, 'use_sliding_window', False)}); "
                "the engine's paged cache serves full-attention layers only"
            )
        self.routing = install_routing(model)  # None for a dense model
        self.routing_rows: list[torch.Tensor] | torch.Tensor | None = None  # the last forward's routing, when asked
        why = unsupported(model) if self.routing is None else "a mixture-of-experts model"
        if why is not None:
            log.info("decode through the model's modules: %s", why)
        self.fused = FusedDecoder(model) if why is None else None  # one function per step, same bits
        self.use_fused = self.fused is not None  # off: every step through the module tree (benchmarks, tests)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @torch.inference_mode()
    def _forward(self, input_ids, mask, positions, cache):
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :].float(), new_cache

    def prefill(
        self,
        prompts: list[list[int]],
        routing: bool = False,
        reserve: list[int] | None = None,
        cached: list[tuple[Entry, int] | None] | None = None,
    ) -> tuple[PagedCache, torch.Tensor]:
        """Run the prompts (left-padded together); returns their rows of the pool and last-position logits.
        With ``routing`` (a MoE model), ``routing_rows`` then holds each prompt's ``[len, layers, top_k]``;
        ``reserve``: each request's whole reservation in blocks, taken at once (engine/paged_cache.py).
        ``cached[i]``: a prefix-cache entry whose first ``n`` positions are prompt i's (``PrefixCache.match``):
        the batch computes only the last columns, those some row has not cached (``cached_columns``), each
        row's earlier positions read from its entry; every row is then written into its own blocks.

        A prompt sent several times at once (a GRPO group) is prefilled once: its keys, values
        and logits are copied to every request that has it. Each distinct prompt's rows are what
        an unshared prefill computes in the batch of distinct prompts; with the batch-invariant
        forward they are the same bits as any unshared prefill.
        """
        first: dict = {}  # key -> (prefill row, the first request with it)
        index = [
            first.setdefault(tuple(p) if self.share_prompts else i, (len(first), i))[0] for i, p in enumerate(prompts)
        ]
        distinct = [list(prompts[i]) for _, i in first.values()]
        hits = [None if cached is None else cached[i] for _, i in first.values()]
        self._record(routing)
        layers, logits, starts = self._prefill(distinct, hits)
        if routing:
            flat, width = self.routing.stacked(), max(len(p) for p in distinct) - max(starts)
            rows = [
                _routing_row(flat[j * width : (j + 1) * width], len(p) - start, hit, start)
                for j, (p, hit, start) in enumerate(zip(distinct, hits, starts))
            ]
            self.routing_rows = [rows[j] for j in index]
        cache = PagedCache(self.pool)
        cache.append(layers, [len(p) for p in prompts], index, reserve=reserve)
        return cache, logits[torch.tensor(index, device=logits.device)] if len(distinct) < len(prompts) else logits

    def _prefill(
        self, prompts: list[list[int]], hits: list[tuple[Entry, int] | None]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, list[int]]:
        """Left-padded keys and values per layer, the last-position logits of ``prompts``, and how many
        first positions of each were read from its prefix-cache hit instead of computed."""
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p)
            mask[i, length - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        starts = cached_columns([len(p) for p in prompts], [0 if h is None else h[1] for h in hits])
        past = max(starts)  # the first columns, read from the cache instead of computed
        cache = DynamicCache()
        if past:  # each row's cached positions right-aligned in them; the pads read block 0, masked
            slots = torch.zeros(len(prompts), past, dtype=torch.long)
            for j, (hit, start) in enumerate(zip(hits, starts)):
                if start:
                    slots[j, past - start :] = self.pool.slots(hit[0].blocks, 0, start)
            slots = slots.reshape(-1).to(self.device)
            for layer in range(self.pool.num_layers):
                kv = self.pool.flat(layer).index_select(2, slots)  # [2, kv_heads, rows * past, d]
                kv = kv.view(2, kv.shape[1], len(prompts), past, kv.shape[3]).transpose(1, 2)
                cache.update(kv[0], kv[1], layer)
        logits, cache = self._forward(ids[:, past:], mask, positions[:, past:], cache)
        return [(layer.keys, layer.values) for layer in cache.layers], logits, starts

    def _record(self, routing: bool) -> None:
        self.routing_rows = None
        if routing:
            if self.routing is None:
                raise EngineError("return_routed_experts: the model has no experts to route")
            self.routing.record_next()

    def decode(
        self, batch: PagedCache, last_tokens: torch.Tensor, positions: torch.Tensor, routing: bool = False
    ) -> torch.Tensor:
        """One decode step for every row: each row's key and value written at its own position. With
        ``routing``, ``routing_rows`` then holds the ``[rows, layers, top_k]`` experts of the fed tokens."""
        self._record(routing)
        if self.use_fused:
            self.fused.check()
            return self.fused.step(batch, last_tokens.to(self.device), positions.to(self.device))
        mask = batch.prepare_decode()
        logits, _ = self._forward(last_tokens[:, None].to(self.device), mask, positions[:, None].to(self.device), batch)
        batch.finish_decode()
        if routing:
            self.routing_rows = self.routing.stacked()
        return logits

    @staticmethod
    def merge(a: PagedCache | None, b: PagedCache) -> PagedCache:
        """Rows of ``a`` then rows of ``b`` (only ``b``'s rows are copied)."""
        if a is None or a.size == 0:
            return b
        a.extend(b)
        return a

    @staticmethod
    def keep(batch: PagedCache, rows: list[int]) -> tuple[PagedCache | None, list[int]]:
        """Only the given rows; returns the batch (None when empty) and the kept rows' old indices
        in their new order."""
        order = batch.keep(rows)
        return (batch if order else None), order


def cached_columns(lengths: list[int], hits: list[int]) -> list[int]:
    """How many first positions of each prompt a batched prefill reads from its prefix-cache hit
    (``hits[i]`` positions cached, 0 for none): the batch computes the same last columns of every row,
    as many as its longest rest (a prompt less its cached positions), so a prompt reads ``length - rest``
    of its cached positions, none when it is no longer than that (so none without a hit in the batch)."""
    rest = max(n - h for n, h in zip(lengths, hits))
    return [max(0, n - rest) for n in lengths]


def _routing_row(computed: torch.Tensor, count: int, hit: tuple[Entry, int] | None, start: int) -> torch.Tensor | None:
    """A prompt's ``[len, layers, top_k]`` routing: its cached positions' experts, kept with its entry, then
    the last ``count`` rows this forward routed (None where the entry kept none: such a row did not ask)."""
    rows = computed[computed.shape[0] - count :]
    if not start:
        return rows
    if hit[0].routing is None:
        return None
    return torch.cat([torch.from_numpy(hit[0].routing[:start]).to(rows.dtype), rows])
