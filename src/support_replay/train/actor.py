"""The actor: a Hugging Face causal LM sharded with FSDP2, scoring samples two ways.

Per response token the actor yields the support-normalised log-prob (the policy ratio
under replay, on the captured S_t) and, when asked, the full-vocabulary log-prob and
entropy (KL to the reference, entropy bonus, metrics). Only response positions reach the
LM head; when no full-vocabulary score is needed the head is applied to the support rows
of its weight alone (``sparse_head_support_logprobs``), never forming ``[T, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from ..batch_invariant import make_batch_invariant
from ..logprobs import full_logprobs_and_entropy, sparse_head_support_logprobs, support_logprobs
from ..rollout.sample import Sample
from ..support import SupportTable

_PREFIX = "hf."


@dataclass
class Scores:
    """Flat per-token scores of a list of samples, response tokens in sample order."""

    logp: torch.Tensor  # support-normalised under replay, else full-vocabulary
    full: torch.Tensor | None
    entropy: torch.Tensor | None
    lengths: list[int]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(values, self.lengths))


class ScoringModel(nn.Module):
    """A causal LM whose forward returns per-token scores of chosen positions.

    One module, so that FSDP2 can make it the root: the embeddings, the final norm and
    the LM head weight are unsharded inside this forward, gradients included.
    """

    def __init__(self, hf: nn.Module, batch_invariant: bool = False):
        super().__init__()
        if batch_invariant:  # the engine's deterministic forward, so logits agree bit for bit
            make_batch_invariant(hf)
        self.hf = hf
        head = hf.get_output_embeddings()
        cfg = hf.config
        # the sparse head computes h . W_j: only valid for a plain bias-free linear head
        # (and not in true-on-policy mode, where the head must be the engine's own product)
        self.plain_head = (
            not batch_invariant and isinstance(head, nn.Linear) and head.bias is None
            and not getattr(cfg, "final_logit_softcapping", None) and getattr(cfg, "logit_scale", 1.0) in (None, 1.0)
        )

    def forward(self, input_ids, attention_mask, rows_b, rows_t, targets, support, temperature, *, replay: bool, full: bool, entropy: bool, full_detached: bool = False):
        hidden = self.hf.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = hidden[rows_b, rows_t]
        need_logits = full or entropy or not replay or not self.plain_head
        full_lp = ent = None
        if need_logits:
            logits = self.hf.get_output_embeddings()(h)
            full_lp, ent = full_logprobs_and_entropy(logits, targets, temperature)
            logp = support_logprobs(logits, targets, support, temperature) if replay else full_lp
        else:
            logp = sparse_head_support_logprobs(h, self.hf.get_output_embeddings().weight, targets, support, temperature)
            if full_detached:  # for metrics only: no graph, no [T, V] gradient
                with torch.no_grad():
                    full_lp, _ = full_logprobs_and_entropy(self.hf.get_output_embeddings()(h.detach()), targets, temperature)
        return logp, full_lp, ent


def load_scoring_model(path, device, batch_invariant: bool = False) -> ScoringModel:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    hf.config.use_cache = False
    return ScoringModel(hf, batch_invariant)


def score_samples(
    model: ScoringModel, samples: list[Sample], temperature: float, *, replay: bool, full: bool, entropy: bool = False, full_detached: bool = False, device="cpu"
) -> Scores:
    """One forward over right-padded sequences, scoring the rows that predict response tokens."""
    lengths = [s.response_length for s in samples]
    width = max(len(s.prompt_ids) + s.response_length for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    rows_b, rows_t = [], []
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        rows_b += [i] * s.response_length
        rows_t += range(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + s.response_length)
    targets = torch.tensor([t for s in samples for t in s.response_ids], device=device)
    support = SupportTable.concat([s.support for s in samples]).to_padded(device=device) if replay else None
    logp, full_lp, ent = model(
        ids.to(device), mask.to(device), torch.tensor(rows_b, device=device), torch.tensor(rows_t, device=device),
        targets, support, temperature, replay=replay, full=full, entropy=entropy, full_detached=full_detached,
    )
    return Scores(logp=logp, full=full_lp if (full or full_detached) else None, entropy=ent if entropy else None, lengths=lengths)


class Actor:
    def __init__(self, path, ctx, *, lr: float, betas: tuple[float, float], weight_decay: float, batch_invariant: bool = False):
        self.ctx = ctx
        self.model = load_scoring_model(path, ctx.device, batch_invariant)
        if ctx.world > 1:  # one rank has nothing to shard: plain parameters, no DTensor overhead
            mesh = init_device_mesh(ctx.device.type, (ctx.world,))
            for layer in self.model.hf.get_decoder().layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)

    def score(self, samples: list[Sample], temperature: float, *, replay: bool, full: bool, entropy: bool = False, full_detached: bool = False) -> Scores:
        return score_samples(self.model, samples, temperature, replay=replay, full=full, entropy=entropy, full_detached=full_detached, device=self.ctx.device)

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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU weights under the Hugging Face names, on rank 0 (every rank must call it)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix(_PREFIX): v for k, v in state.items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(self.model, {_PREFIX + k: v for k, v in state.items()}, options=StateDictOptions(full_state_dict=True, strict=False))
