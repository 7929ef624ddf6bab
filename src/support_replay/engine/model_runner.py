"""Batched prefill and decode of a Hugging Face causal LM over one left-padded KV cache.

Rows of the batch are sequences of different lengths, left-padded to a common cache
length (identical prompts admitted together are prefilled once and their rows copied); the 2-D attention mask hides the padding and explicit position ids keep every
sequence's positions its own. New sequences are prefilled as a group and merged into the
running cache between decode steps (continuous batching); finished ones are dropped and
fully padded columns on the left are trimmed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..errors import EngineError


def load_model_and_tokenizer(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    path = Path(path)
    if not (path / "config.json").exists():
        raise EngineError(f"hf_checkpoint: {path} has no config.json (a Hugging Face checkpoint directory is expected)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


@dataclass
class KVBatch:
    """The running batch: cache ``[B, heads, L, dim]`` per layer and attention mask ``[B, L]``."""

    cache: DynamicCache | None
    mask: torch.Tensor  # long [B, L]

    @property
    def size(self) -> int:
        return self.mask.shape[0]


def _layers(cache: DynamicCache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class ModelRunner:
    def __init__(self, model, device: str = "cpu"):
        self.model = model
        self.device = device
        params = inspect.signature(model.forward).parameters
        # transformers 5 calls the cache argument `cache`; earlier releases `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

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

    def prefill(self, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
        """Run the prompts (left-padded together); returns their batch and last-position logits.

        A prompt sent several times at once (a GRPO group) is prefilled once: its cache rows and
        logits are copied to every request that has it. Each distinct prompt's rows are what an
        unshared prefill computes in the batch of distinct prompts; with the batch-invariant
        forward they are the same bits as any unshared prefill.
        """
        first: dict[tuple[int, ...], int] = {}
        index = [first.setdefault(tuple(p), len(first)) for p in prompts]
        if len(first) == len(prompts):
            return self._prefill(prompts)
        batch, logits = self._prefill([list(p) for p in first])
        rows = torch.tensor(index, dtype=torch.long, device=batch.mask.device)
        layers = [(k[rows], v[rows]) for k, v in _layers(batch.cache)]
        return KVBatch(DynamicCache(ddp_cache_data=layers), batch.mask[rows]), logits[rows]

    def _prefill(self, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p)
            mask[i, length - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        logits, cache = self._forward(ids, mask, positions, DynamicCache())
        return KVBatch(cache, mask), logits

    def decode(self, batch: KVBatch, last_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for every row; grows the cache by one column."""
        mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], dim=1)
        logits, batch.cache = self._forward(last_tokens[:, None].to(self.device), mask, positions[:, None].to(self.device), batch.cache)
        batch.mask = mask
        return logits

    @staticmethod
    def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
        """Rows of ``a`` then rows of ``b``, left-padded to a common length."""
        if a is None or a.size == 0:
            return b
        length = max(a.mask.shape[1], b.mask.shape[1])
        layers = [
            (torch.cat([_left_pad(ka, length, 2), _left_pad(kb, length, 2)]), torch.cat([_left_pad(va, length, 2), _left_pad(vb, length, 2)]))
            for (ka, va), (kb, vb) in zip(_layers(a.cache), _layers(b.cache))
        ]
        mask = torch.cat([_left_pad(a.mask, length, 1), _left_pad(b.mask, length, 1)])
        return KVBatch(DynamicCache(ddp_cache_data=layers), mask)

    @staticmethod
    def keep(batch: KVBatch, rows: list[int]) -> KVBatch | None:
        """Only the given rows; trims columns that are padding in every remaining row."""
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
        mask = batch.mask[index]
        start = int((mask.sum(0) > 0).nonzero()[0]) if mask.numel() else 0
        layers = [(k[index, :, start:], v[index, :, start:]) for k, v in _layers(batch.cache)]
        return KVBatch(DynamicCache(ddp_cache_data=layers), mask[:, start:])
