"""The actor: a Hugging Face causal LM sharded with FSDP2 (and TP / CP), its optimizer, and the
scorers of its policy ratio.

``ScoringModel`` runs the decoder to the final hidden state of every response position and hands
those rows to a ``Scorer`` (train/scorer.py) inside its forward, where FSDP2 has unsharded the
head. Which head scores the ratio is fixed when the actor is built (sparse, union, dense,
vocab-parallel, penalised; docs/math.md, "which function scores"), so the old and the new
log-probs of a PPO ratio are one function. Packed micro-batches score the same way.

A mixture-of-experts model runs the sparse blocks of modeling/moe.py (the engine's). Under routing
replay (``--use-rollout-routing-replay``) the actor's forwards route every position to the experts
the engine chose (``MicroBatch.routing``); the reference model, a separate forward, keeps its own
routing (the KL measures the reference as it would act). The full-vocabulary metrics of a pass come
from the same forward as its ratio, the replayed one.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from ..core.logprobs import full_logprobs_and_entropy, support_logprobs
from ..core.parallel import (
    context_parallel_positions,
    vocab_parallel_full_logprobs_and_entropy,
    vocab_parallel_support_logprobs,
)
from ..core.routing import FREE
from ..errors import ConfigError
from ..modeling.batch_invariant import make_batch_invariant
from ..modeling.context_parallel import ContextShard, assemble_rows, make_context_parallel, replicated_sum
from ..modeling.linear_kernels import linear_function, use_linear
from ..modeling.lora import adapter_state, add_lora, from_adapter_state, merged_state
from ..modeling.moe import install_routing
from ..modeling.packed_sequences import use_packed_attention
from ..modeling.tensor_parallel import VocabShard, parallelize_tensor
from .batches import MicroBatch
from .layout import ParallelLayout
from .scorer import BatchScores, Outputs, Scorer

_PREFIX = "hf."


def plain_linear_head(hf: nn.Module) -> bool:
    """The sparse head computes ``h . W_j``: only valid for a bias-free linear head with no logit transform."""
    head, cfg = hf.get_output_embeddings(), hf.config
    return (
        isinstance(head, nn.Linear)
        and head.bias is None
        and not getattr(cfg, "final_logit_softcapping", None)
        and getattr(cfg, "logit_scale", 1.0) in (None, 1.0)
    )


class ScoringModel(nn.Module):
    """A causal LM whose forward returns per-token scores of chosen positions.

    One module, so that FSDP2 can make it the root: the embeddings, the final norm and
    the LM head weight are unsharded inside this forward, gradients included.
    """

    def __init__(
        self,
        hf: nn.Module,
        batch_invariant: bool = False,
        compute_dtype: torch.dtype = torch.float32,
        linear_kernel: str = "torch",
    ):
        super().__init__()
        if batch_invariant:  # the engine's deterministic forward in the compute dtype, so logits agree bit for bit
            make_batch_invariant(hf, compute_dtype)
        else:  # oneDNN's forward products where the run resolved to them (the backward is plain products either way)
            use_linear(hf, linear_function(linear_kernel))
        # sdpa takes a packed row's sequences apart (modeling/packed_sequences.py); the batch-invariant attention
        # reads which keys each query sees off the packed mask
        self.per_sequence_attention = not batch_invariant and use_packed_attention(hf)
        self.hf = hf
        self.routing = install_routing(hf)  # the sparse blocks' switch (None: a dense model)
        self.replay_routing = False  # the actor under --use-rollout-routing-replay
        self.batch_invariant = batch_invariant  # the sparse head then takes the invariant dots (train/scorer.py)
        self.compute_dtype = compute_dtype  # bf16: autocast over fp32 weights
        self.vocab: VocabShard | None = None  # tensor parallel: this rank's LM head rows
        self.tp_group = None
        self.context: tuple | None = None  # context parallel: (group, rank, size, layout)

    def forward(self, batch: MicroBatch, scorer: Scorer):
        """``(logp, full log-prob, entropy)`` of ``batch``'s scored rows, by ``scorer`` (train/scorer.py).

        The head runs inside this forward, where FSDP2 has unsharded it. A packed batch brings its
        own ``position_ids``, a ``[B, 1, L, L]`` mask and its ``segments``
        (``batches.build_packed_micro_batch``; the batch-invariant attention lays each sequence out
        from them). Under context parallelism each rank scores the rows whose logit position it holds
        and every rank gets all rows back.
        """
        # bf16: autocast over the fp32 weights; the batch-invariant forward casts to its dtype itself, as the engine's
        # bf16 model computes (residual adds and norms in bf16 too)
        on = self.compute_dtype != torch.float32 and not self.batch_invariant
        with torch.autocast(batch.input_ids.device.type, dtype=self.compute_dtype, enabled=on):
            h, mine = self._hidden_rows(
                batch.input_ids,
                batch.attention_mask,
                batch.rows_b,
                batch.rows_t,
                batch.position_ids,
                batch.segments,
                self._replayed(batch),
            )
            if mine is None:
                return scorer.rows(h, batch.targets, batch.support, batch.penalty)
            support = (batch.support[0][mine], batch.support[1][mine]) if batch.support is not None else None
            scores = scorer.rows(h, batch.targets[mine], support, batch.penalty)
        group = self.context[0]
        return tuple(assemble_rows(x, mine, group) if x is not None else None for x in scores)

    def _replayed(self, batch: MicroBatch) -> torch.Tensor | None:
        """The routing this forward replays: the batch's, under routing replay; else None (its own)."""
        if not self.replay_routing:
            return None
        if batch.routing is None:
            raise ConfigError(
                f"routing replay: the micro-batch of samples {batch.indices[:8]} carries no routed experts"
            )
        return batch.routing

    def _hidden_rows(self, input_ids, attention_mask, rows_b, rows_t, position_ids=None, segments=None, routing=None):
        """The final hidden state at every chosen row (CP: at this rank's rows, and which those are);
        ``routing`` (``[B, L, layers, top_k]``) routes the sparse blocks' positions."""
        decoder = self.hf.get_decoder()
        if self.context is None:
            # packed rows: the attention takes each sequence's keys from the segments (a keyword the
            # model passes down to its attention function)
            extra = {"packed_segments": segments} if self.per_sequence_attention and segments is not None else {}
            with self._routes(routing):
                hidden = decoder(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **extra
                ).last_hidden_state
            return hidden[rows_b, rows_t], None
        if position_ids is not None:  # refused by the run config (train/config.py)
            raise ConfigError("context parallelism scores unpacked rows only (--packed-scoring off)")
        group, rank, size, layout = self.context
        batch, length = input_ids.shape
        unit = size * (2 if layout == "zigzag" else 1)  # every rank the same number of positions
        extra = -length % unit
        if extra:
            input_ids = torch.nn.functional.pad(input_ids, (0, extra))
            attention_mask = torch.nn.functional.pad(attention_mask, (0, extra))
        padded = length + extra
        device = input_ids.device
        held = [torch.from_numpy(context_parallel_positions(padded, r, size, layout)).to(device) for r in range(size)]
        positions = held[rank]
        shard = ContextShard(group, positions, torch.argsort(torch.cat(held)), attention_mask.bool())
        if routing is not None:  # this rank's positions' experts (padding routes itself)
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, extra), value=FREE)[:, positions]
        with self._routes(routing):
            hidden = decoder(
                input_ids=input_ids[:, positions],
                position_ids=positions[None].expand(batch, -1),
                attention_mask=None,
                context_shard=shard,
            ).last_hidden_state
        local = torch.full((padded,), -1, dtype=torch.long, device=device)
        local[positions] = torch.arange(len(positions), device=device)
        index = local[rows_t]
        mine = index >= 0
        return hidden[rows_b[mine], index[mine]], mine

    def _routes(self, routing):
        """The sparse blocks replay ``routing`` (flattened like the decoder's tokens) within; a no-op without it."""
        if routing is None:
            return nullcontext()
        return self.routing.replaying(routing.reshape(-1, *routing.shape[-2:]))

    def logits_at(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` logits at the padded support ids; under tensor parallelism each rank holds its vocabulary
        columns, so its own ids' values are summed over the TP group (every rank gets all of them)."""
        if self.vocab is None:
            return logits.gather(1, ids)
        start, size = self.vocab.start, logits.shape[1]
        inside = (ids >= start) & (ids < start + size)
        local = logits.gather(1, (ids - start).clamp(0, size - 1))
        return replicated_sum(torch.where(inside, local, torch.zeros_like(local)), self.tp_group)

    def head_functions(self):
        """``(full-vocabulary log-probs and entropy, support log-probs)`` of the logits the head
        returns: the core's, or their vocab-parallel forms over this rank's vocabulary columns."""
        if self.vocab is None:
            return full_logprobs_and_entropy, support_logprobs
        shard = {"vocab_start": self.vocab.start, "group": self.tp_group}
        return partial(vocab_parallel_full_logprobs_and_entropy, **shard), partial(
            vocab_parallel_support_logprobs, **shard
        )


def load_scoring_model(
    path,
    device,
    batch_invariant: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    linear_kernel: str = "torch",
    attn_implementation: str = "sdpa",
    lora=None,
) -> ScoringModel:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    if lora is not None:  # before the forward's linears are chosen: the adapters' own linears take them too
        add_lora(hf, lora)
    hf = hf.to(device)
    hf.config.use_cache = False
    return ScoringModel(hf, batch_invariant, compute_dtype, linear_kernel)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters that may live on different device meshes (FSDP2 alone
    shards the norms and embeddings over ``dp``; with TP the layers sit on ``dp x tp``): the
    norm of each mesh's gradients in full, then one global norm and one clip coefficient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():  # one mesh per call: DTensor multiplies within a mesh only
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def adamw(params, **settings) -> torch.optim.AdamW:
    """AdamW with the fused kernel where the parameters' device has one (CPU and CUDA here: about
    4x faster per step than the loop on this machine), else the default implementation."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **settings)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **settings)


class Actor:
    """The trained model, its optimizer, and the one scoring path of its policy ratio."""

    def __init__(
        self,
        path,
        ctx,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        replay: bool,
        full_with_grad: bool,
        batch_invariant: bool = False,
        penalties: bool = False,
        layout: ParallelLayout | None = None,
        compute_dtype: torch.dtype = torch.float32,
        linear_kernel: str = "torch",
        routing_replay: bool = False,
        attn_implementation: str = "sdpa",
        lora=None,
    ):
        self.ctx = ctx
        self.replay = replay
        self.layout = layout or ParallelLayout()
        self.lora = lora  # LoRA settings (modeling/lora.py): adapters train, the base stays frozen
        self.model = load_scoring_model(
            path, ctx.device, batch_invariant, compute_dtype, linear_kernel, attn_implementation, lora
        )
        hf = self.model.hf
        if routing_replay and self.model.routing is None:
            raise ConfigError(
                f"--use-rollout-routing-replay: {type(hf).__name__} is a dense model (it has no experts to route)"
            )
        self.model.replay_routing = routing_replay
        self.routing_shape = self.model.routing.shape if self.model.routing is not None else None
        # true-on-policy: the sparse head's logits by the invariant dot, the engine's bits (train/scorer.py)
        # penalties transform the logits at the support ids: the dense head, so one path scores every pass
        # tensor parallel: the vocab-parallel dense head (the sparse head would gather rows across ranks)
        self.sparse_head = (
            replay and not full_with_grad and not penalties and plain_linear_head(hf) and self.layout.tp == 1
        )
        if self.layout.tp > 1:
            self.model.vocab = parallelize_tensor(hf, self.layout.mesh["tp"])
            self.model.tp_group = self.layout.group("tp")
        if self.layout.cp > 1:
            make_context_parallel(hf, self.layout.cp)
            self.model.context = (self.layout.group("cp"), self.layout.cp_rank, self.layout.cp, self.layout.cp_layout)
        if ctx.world > 1:  # one rank has nothing to shard: plain parameters, no DTensor overhead
            mesh = self.layout.fsdp_mesh
            for layer in hf.get_decoder().layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(trainable, lr=lr, betas=betas, weight_decay=weight_decay)
        self.scheduler = None  # the learning-rate schedule (train/schedule.py), stepped after every optimizer step
        self.schedule: dict | None = None  # its settings (RunConfig.lr_schedule): a checkpoint keeps them
        self.last_lr = lr  # the learning rate of the last optimizer step

    @classmethod
    def for_run(cls, path, ctx, *, rollout, optimizer, replay, linear_kernel: str, layout=None, full_with_grad=False):
        """The actor of a run from the sections it reads (the recipe's, and the audit's with the same forward)."""
        return cls(
            path,
            ctx,
            lr=optimizer.lr,
            betas=(optimizer.adam_beta1, optimizer.adam_beta2),
            weight_decay=optimizer.weight_decay,
            replay=rollout.use_sampling_support_replay,
            full_with_grad=full_with_grad,
            batch_invariant=replay.true_on_policy_mode,
            penalties=rollout.penalties.active,
            layout=layout,
            compute_dtype=getattr(torch, replay.train_dtype),
            linear_kernel=linear_kernel,
            routing_replay=replay.use_rollout_routing_replay,
            attn_implementation=replay.attn_implementation,
            lora=optimizer.lora,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.hf.get_output_embeddings().weight.shape[0]

    def scorer(self, temperature: float, outputs: Outputs = Outputs()) -> Scorer:
        """The scoring function of this actor's policy ratio with ``outputs`` beside it, chosen now."""
        return Scorer(self.model, temperature, replay=self.replay, sparse=self.sparse_head, outputs=outputs)

    def score(self, batch: MicroBatch, temperature: float, outputs: Outputs = Outputs()) -> BatchScores:
        """One micro-batch through a scorer built for it (tests and one-off scoring; the recipe keeps its scorers)."""
        return self.scorer(temperature, outputs)(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Losses are normalised by the global token count already; FSDP averages gradients
        over its ranks, so scale by their number to get the sum (gloo has no PREMUL_SUM)."""
        (loss * self.layout.gradient_scale()).backward()

    def clip_and_step(self, max_norm: float) -> float | None:
        """The gradient norm after a clipped step, or None (no step, gradients dropped) when it is not finite."""
        norm = float(clip_gradients(list(self.model.parameters()), max_norm if max_norm > 0 else float("inf")))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU weights under the Hugging Face names, on rank 0 (every rank must call it); with LoRA
        the merged weights."""
        return self.checkpoint_state()[0]

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """``(full_state_dict(), the LoRA adapter alone in peft's saved layout or None)`` from one gather of the
        unsharded weights (every rank must call it)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = {k.removeprefix(_PREFIX): v for k, v in state.items()}
        if self.lora is None:
            return state, None
        return merged_state(state, self.lora.scaling), adapter_state(state)

    def load_adapter_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(
            self.model,
            {_PREFIX + k: v for k, v in from_adapter_state(saved).items()},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(
            self.model,
            {_PREFIX + k: v for k, v in state.items()},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
