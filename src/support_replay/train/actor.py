"""The actor: a Hugging Face causal LM sharded with FSDP2, scoring samples two ways.

Per response token the actor yields the support-normalised log-prob (the policy ratio
under replay, ``support_logprobs`` on the captured S_t) and, when asked, the
full-vocabulary log-prob and entropy (KL to the reference, entropy bonus, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from ..logprobs import full_logprobs_and_entropy, support_logprobs
from ..rollout.sample import Sample
from ..support import SupportTable


@dataclass
class Scores:
    """Flat per-token scores of a list of samples, response tokens in sample order."""

    logp: torch.Tensor  # support-normalised under replay, else full-vocabulary
    full: torch.Tensor | None
    entropy: torch.Tensor | None
    lengths: list[int]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(values, self.lengths))


def load_causal_lm(path, device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    return model


class Actor:
    def __init__(self, path, ctx, *, lr: float, betas: tuple[float, float], weight_decay: float):
        self.ctx = ctx
        self.model = load_causal_lm(path, ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        for layer in self.model.get_decoder().layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)

    def score(self, samples: list[Sample], temperature: float, *, replay: bool, full: bool, entropy: bool = False) -> Scores:
        return score_samples(self.model, samples, temperature, replay=replay, full=full, entropy=entropy, device=self.ctx.device)

    def backward(self, loss: torch.Tensor) -> None:
        """Losses are normalised by the global token count already; FSDP averages gradients
        over ranks, so scale by the world size to get their sum (gloo has no PREMUL_SUM)."""
        (loss * self.ctx.world).backward()

    def clip_and_step(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


def score_samples(model, samples: list[Sample], temperature: float, *, replay: bool, full: bool, entropy: bool = False, device="cpu") -> Scores:
    """One forward over right-padded sequences; rows that predict each response token."""
    lengths = [s.response_length for s in samples]
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    rows = torch.cat([logits[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + n] for i, (s, n) in enumerate(zip(samples, lengths))])
    targets = torch.tensor([t for s in samples for t in s.response_ids], device=rows.device)
    full_lp = ent = None
    if full or entropy or not replay:
        full_lp, ent = full_logprobs_and_entropy(rows, targets, temperature)
    if replay:
        support = SupportTable.concat([s.support for s in samples])
        logp = support_logprobs(rows, targets, support, temperature)
    else:
        logp = full_lp
    return Scores(logp=logp, full=full_lp if full else None, entropy=ent if entropy else None, lengths=lengths)
