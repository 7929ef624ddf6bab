"""The update side of a run: the actor and the reference, scoring before the update, the loss
of every micro-batch (weighted by ``core/losses.py``), the optimizer step and its metrics.

Every pass over a rollout uses the micro-batches planned once (``batches.py``) and the
actor's one scoring path, so old and new log-probs of a ratio are the same function on the
same batch. Results come back as values; nothing is mutated across calls.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields, replace

import torch

from ..core.losses import (
    grpo_advantages,
    importance_weights,
    kl_estimate,
    policy_token_loss,
    score_centering_term,
    token_weights,
)
from ..errors import ConfigError, NonFiniteError
from ..rollout.sample import Sample, check_sample_routing, check_sample_support_logq
from .actor import Actor, load_scoring_model
from .batches import MicroBatch, OptimizerStep, plan_optimizer_steps
from .config import RunConfig
from .dist import all_reduce_sum, gather_by_index
from .distillation import DistillSums, distill_metrics, distill_terms
from .distillation_config import DistillationConfig
from .layout import parallel_layout
from .remote_teacher import RemoteTeacher
from .schedule import lr_scheduler
from .scorer import Outputs, Scorer
from .sections import AgentConfig, OptimizerConfig, ParallelConfig, ReplayConfig, RolloutConfig
from .teacher import Teacher, TeacherScores


@dataclass(frozen=True)
class OldScores:
    """Per-sample scores before the rollout's first optimizer step (lists in sample order)."""

    logp: list[torch.Tensor] | None  # the ratio's score; None until the fused forward ran
    full: list[torch.Tensor] | None  # full-vocabulary log-probs (metrics, KL reward)
    ref: list[torch.Tensor] | None  # the reference's full-vocabulary log-probs
    teacher: TeacherScores | None = None  # --use-opd: the teacher's log-probs at the support ids and sampled tokens


@dataclass
class StepSums:
    """Sums over one optimizer step's micro-batches (this rank's, then all ranks')."""

    loss: float = 0.0
    clipped_tokens: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    tokens: float = 0.0
    sc_drift: float = 0.0  # score centering: sum over trained tokens of |A| * the drift's logit-gradient norm
    # --use-opd (train/distillation.DistillSums, field by field): sums over trained tokens
    opd_exact: float = 0.0
    opd_exact_sq: float = 0.0
    opd_single: float = 0.0
    opd_single_sq: float = 0.0
    opd_mass: float = 0.0
    opd_agree: float = 0.0

    def add(self, other: StepSums) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class UpdateMetrics:
    """One rollout's update, averaged over its optimizer steps."""

    loss: float
    clip_fraction: float
    kl_loss: float
    entropy: float
    grad_norm: float
    optimizer_steps: int
    lr: float  # the learning rate of the rollout's last optimizer step
    score_centering_drift: float | None = None  # mean over trained tokens of |A| sum_v |q_v w_v - p_v sum_u q_u w_u|
    distillation: dict | None = None  # --use-opd: train/distillation.distill_metrics over the rollout's tokens

    def row(self) -> dict:
        """The metrics row's fields (what was not measured left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return {**out, **out.pop("distillation", {})}

    @staticmethod
    def mean(
        steps: list[tuple[StepSums, float]], lr: float, centering: bool = False, distilling: str | None = None
    ) -> UpdateMetrics:
        """From ``(sums, grad norm)`` per optimizer step: per-token means, averaged over steps (the drift
        only where score centering measured it; distillation's over the rollout's tokens)."""
        n = len(steps)
        whole = StepSums()
        for s, _ in steps:
            whole.add(s)
        opd = DistillSums(*(getattr(whole, f"opd_{f.name}") for f in fields(DistillSums)))
        return UpdateMetrics(
            loss=sum(s.loss for s, _ in steps) / n,
            clip_fraction=sum(s.clipped_tokens / max(s.tokens, 1) for s, _ in steps) / n,
            kl_loss=sum(s.kl / max(s.tokens, 1) for s, _ in steps) / n,
            entropy=sum(s.entropy / max(s.tokens, 1) for s, _ in steps) / n,
            grad_norm=sum(norm for _, norm in steps) / n,
            optimizer_steps=n,
            lr=lr,
            score_centering_drift=sum(s.sc_drift / max(s.tokens, 1) for s, _ in steps) / n if centering else None,
            distillation=distill_metrics(opd, whole.tokens, distilling) if distilling else None,
        )


@dataclass
class BackwardResult:
    sums: StepSums  # over every rank
    scores: dict[
        int, tuple[torch.Tensor, torch.Tensor]
    ]  # this rank's samples -> (logp, full) of this forward, detached


def episode_index(samples: list[Sample]) -> list[int] | None:
    """The episode of every sample when some episode gave more than one sample, else None."""
    episodes = [s.metadata.get("episode", s.index) for s in samples]
    return episodes if len(set(episodes)) < len(samples) else None


def refuse_non_finite(total: torch.Tensor, batch: MicroBatch, rollout: int) -> None:
    """``NonFiniteError`` naming the sample and the response position of the first non-finite loss term."""
    bad = ~torch.isfinite(total) & (batch.loss_mask > 0)
    if not bool(bad.any()):
        return
    n = int(bad.nonzero()[0])
    ends = torch.cumsum(torch.tensor(batch.lengths), 0)
    row = int((ends <= n).sum())
    raise NonFiniteError(
        f"rollout {rollout}, sample {batch.indices[row]}, response position {n - int(ends[row - 1] if row else 0)}: "
        f"the loss is {float(total[n].detach())}; the run stops before anything is pushed or saved"
    )


@torch.no_grad()
def step_sums(loss, terms, mask, token_advantages, drift, opd: DistillSums | None = None) -> StepSums:
    """A micro-batch's sums for the step's metrics."""
    opd = opd or DistillSums()
    return StepSums(
        **{f"opd_{f.name}": getattr(opd, f.name) for f in fields(DistillSums)},
        loss=float(loss),
        clipped_tokens=float((terms.clipped.float() * mask).sum()),
        kl=float((terms.kl * mask).sum()) if terms.kl is not None else 0.0,
        entropy=float((terms.entropy * mask).sum()) if terms.entropy is not None else 0.0,
        tokens=float(mask.sum()),
        sc_drift=float((token_advantages.abs() * drift * mask).sum()) if drift is not None else 0.0,
    )


class Learner:
    def __init__(
        self,
        ctx,
        checkpoint_path,
        *,
        rollout: RolloutConfig,
        parallel: ParallelConfig,
        optimizer: OptimizerConfig,
        replay: ReplayConfig,
        agents: AgentConfig,
        distillation: DistillationConfig,
        pack: bool,
        linear_kernel: str,
        lr_schedule: dict | None = None,
    ):
        self.ctx = ctx
        self.rollout_cfg, self.parallel_cfg, self.optimizer_cfg = rollout, parallel, optimizer
        self.replay_cfg, self.agents_cfg, self.distill_cfg = replay, agents, distillation
        self.replay = self.rollout_cfg.use_sampling_support_replay
        self.layout = parallel_layout(
            ctx,
            tp=self.parallel_cfg.tensor_model_parallel_size,
            cp=self.parallel_cfg.context_parallel_size,
            cp_layout=self.parallel_cfg.context_parallel_layout,
        )
        self._check_layout(self.layout.dp)
        self._planned_steps = 1
        self.measure_full = True  # full-vocabulary scores for the metrics in this rollout
        torch.manual_seed(self.optimizer_cfg.seed)
        self.linear_kernel = linear_kernel  # the actor's, the reference's and the lagged scorer's forward
        self.actor, self.reference = self._models(checkpoint_path)
        self.actor.source = checkpoint_path  # a checkpoint saves its tokenizer beside the weights
        self.teacher = self._teacher(checkpoint_path) if distillation.use_opd else None
        self.actor.schedule = lr_schedule  # what a checkpoint keeps of it, and a resume must match
        self.actor.scheduler = lr_scheduler(self.actor.optimizer, **lr_schedule) if lr_schedule else None
        self.temperature = self.rollout_cfg.rollout_temperature
        self._build_scorers()
        self.pack = pack  # decided once: the rule reads the rollout's penalties (a file for a logit bias)

    def _check_layout(self, dp: int) -> None:
        """What the data-parallel layout needs of the batches: the same number of micro-batches on every rank."""
        self.parallel_cfg.check_world(self.ctx.world)  # Miles' --actor-num-* against the torchrun world
        if self.parallel_cfg.global_batch_size % dp:
            raise ConfigError(
                f"--global-batch-size={self.parallel_cfg.global_batch_size}: must be a multiple of the {dp} "
                "data-parallel ranks, so that every rank runs as many micro-batches"
            )
        if self.agents_cfg.enabled and self.agents_cfg.session_history_policy == "split" and dp > 1:
            raise ConfigError(
                f"--session-history-policy=split with {dp} data-parallel ranks: split episodes make the number of "
                "samples vary, and the ranks would run different numbers of micro-batches; use "
                "--session-history-policy reject with several ranks"
            )

    def _models(self, checkpoint_path):
        """The actor (FSDP2, TP / CP per the layout) and, for a KL term, the frozen reference."""
        opt, ctx = self.optimizer_cfg, self.ctx
        actor = Actor.for_run(
            checkpoint_path,
            ctx,
            rollout=self.rollout_cfg,
            optimizer=opt,
            replay=self.replay_cfg,
            linear_kernel=self.linear_kernel,
            layout=self.layout,
            full_with_grad=opt.use_kl_loss or opt.entropy_coef > 0,
        )
        reference = (
            load_scoring_model(
                checkpoint_path,
                ctx.device,
                compute_dtype=actor.model.compute_dtype,
                linear_kernel=self.linear_kernel,
                attn_implementation=self.replay_cfg.attn_implementation,
            )
            .eval()
            .requires_grad_(False)
            if opt.needs_reference
            else None
        )
        return actor, reference

    def _teacher(self, checkpoint_path) -> Teacher | RemoteTeacher:
        """--use-opd's teacher: in process (--opd-teacher-load) or served (--opd-teacher-url)."""
        cfg = self.distill_cfg
        if cfg.opd_teacher_url:
            return RemoteTeacher(cfg.opd_teacher_url, checkpoint_path, self.actor.vocab_size)
        return Teacher.load(
            checkpoint_path,
            cfg.opd_teacher_load,
            self.ctx.device,
            self.actor.model.compute_dtype,
            self.linear_kernel,
            self.replay_cfg.attn_implementation,
        )

    def _build_scorers(self) -> None:
        # every pass's scoring function, chosen now (train/scorer.py); which one runs depends on whether this
        # rollout measures full-vocabulary scores and whether the update's forward is the old policy's (fused)
        self._old_scorers = {m: self.actor.scorer(self.temperature, Outputs(full_detached=m)) for m in (False, True)}
        grads = dict(
            full=self.optimizer_cfg.use_kl_loss,
            entropy=self.optimizer_cfg.entropy_coef > 0,
            support_rows=self.optimizer_cfg.use_score_centering or self.distill_cfg.use_opd,
        )
        self._update_scorers = {
            m: self.actor.scorer(self.temperature, Outputs(**grads, full_detached=m)) for m in (False, True)
        }
        self._reference_scorer = (
            Scorer(self.reference, self.temperature, replay=self.replay, sparse=False, outputs=Outputs(full=True))
            if self.reference is not None
            else None
        )

    @classmethod
    def from_config(cls, cfg: RunConfig, ctx, checkpoint_path) -> Learner:
        """The learner of a run: the sections it uses, and what the run derives across them."""
        return cls(
            ctx,
            checkpoint_path,
            rollout=cfg.rollout,
            parallel=cfg.parallel,
            optimizer=cfg.optimizer,
            replay=cfg.replay,
            agents=cfg.agents,
            distillation=cfg.distillation,
            pack=cfg.pack_groups,
            linear_kernel=cfg.trainer_linear_kernel(ctx.device),
            lr_schedule=cfg.lr_schedule,
        )

    @property
    def vocab_size(self) -> int:
        return self.actor.vocab_size

    @property
    def routing_shape(self):
        """The trained model's routing shape (None: a dense model)."""
        return self.actor.routing_shape

    _agreement: tuple[int, int] = (0, 0)  # the last old-policy pass's (equal top-k sets, compared)

    def _take_agreement(self) -> tuple[int, int]:
        routing = self.actor.model.routing
        return routing.take_agreement() if routing is not None else (0, 0)

    def routing_metrics(self) -> dict:
        """``routing_agreement``: the share of token-layer choices where the old policy's own top-k (the
        actor before this rollout's update) equalled the replayed one, every rank; empty without routing replay."""
        if not self.actor.model.replay_routing:
            return {}
        same, compared = all_reduce_sum([float(v) for v in self._agreement], self.ctx)
        return {"routing_agreement": same / compared} if compared else {}

    def teacher_metrics(self) -> dict:
        """A served teacher's ids sent, ids needed and seconds in this rollout (empty otherwise)."""
        return self.teacher.take_stats() if isinstance(self.teacher, RemoteTeacher) else {}

    @property
    def fused(self) -> bool:
        """One optimizer step per rollout and no KL reward: the update's own forward, taken
        before the step, gives the old log-probs, so no separate scoring pass is needed."""
        one_step = (
            self.parallel_cfg.global_batch_size
            == self.rollout_cfg.rollout_batch_size * self.rollout_cfg.n_samples_per_prompt
            and self._planned_steps == 1
        )
        return (
            one_step and self.optimizer_cfg.kl_coef == 0 and self.replay_cfg.min_support_mass == 0
        )  # the drift gate reads the old scores before the update

    def plan(
        self, samples: list[Sample], rollout: int = 0, penalty_semantics: str | None = None
    ) -> list[OptimizerStep]:
        """This rank's micro-batches of the rollout; agent episodes split by a history rewrite can
        make more samples, hence more optimizer steps, than the config alone says. Decides too
        whether this rollout pays for the metrics-only full-vocabulary head. Penalties are
        replayed by ``penalty_semantics``, the sampling engine's rules (default: the in-process
        engine's, ``--sampling-semantics``)."""
        ctx = self.ctx
        if self.replay_cfg.use_rollout_routing_replay:  # before any forward: every sample's routing fits the model
            for s in samples:
                check_sample_routing(s, self.routing_shape)
        if self.optimizer_cfg.use_score_centering:  # and carries the sampler's log q of every support id
            for s in samples:
                check_sample_support_logq(s)
        self.measure_full = (
            not self.replay
            or self.optimizer_cfg.kl_coef > 0
            or self.replay_cfg.min_support_mass > 0
            or rollout % self.replay_cfg.full_vocab_metrics_interval == 0
            or self.teacher is not None  # the one-sample estimate reads the old full-vocabulary log pi(a_t)
        )
        steps = plan_optimizer_steps(
            samples,
            global_batch=self.parallel_cfg.global_batch_size,
            micro_batch=self.parallel_cfg.micro_batch,
            rank=self.layout.dp_rank,
            world=self.layout.dp,
            replay=self.replay,
            device=ctx.device,
            penalty_semantics=penalty_semantics or self.rollout_cfg.sampling_semantics,
            max_tokens=self.parallel_cfg.max_tokens_per_micro_batch,
            pack=self.pack,
        )
        self._planned_steps = len(steps)
        return steps

    # ---- before the update --------------------------------------------------------------

    @torch.no_grad()
    def score_before_update(
        self, steps: list[OptimizerStep], num_samples: int, samples: list[Sample] | None = None
    ) -> OldScores:
        """Old log-probs (unless fused) and the reference's, on the planned micro-batches."""
        old, ref, taught = {}, {}, {}
        self._take_agreement()  # routing agreement is the old policy's: measured on this pass (or the fused forward)
        for batch in (mb for step in steps for mb in step.micro_batches):
            if not self.fused:
                sc = self._old_scorers[self.replay and self.measure_full](batch)
                full = sc.full if sc.full is not None else sc.logp
                old.update(zip(batch.indices, zip(batch.split(sc.logp), batch.split(full))))
            if self.reference is not None:
                rs = self._reference_scorer(batch)
                ref.update(zip(batch.indices, batch.split(rs.full)))
            if self.teacher is not None:
                taught.update(self.teacher.score(batch, samples))  # a served teacher reads the samples
        if not self.fused:
            self._agreement = self._take_agreement()
        pairs = gather_by_index(old, num_samples, self.ctx) if old else None
        refs = gather_by_index(ref, num_samples, self.ctx) if ref else None
        teacher = gather_by_index(taught, num_samples, self.ctx) if taught else None
        return OldScores(
            logp=[p[0] for p in pairs] if pairs else None,
            full=[p[1] for p in pairs] if pairs and self.measure_full else None,
            ref=refs,
            teacher=TeacherScores([t[0] for t in teacher], [t[1] for t in teacher]) if teacher else None,
        )

    def with_fresh_old(self, old: OldScores, scores: dict, num_samples: int) -> OldScores:
        """The fused forward's own scores, from every rank, as the old policy's."""
        pairs = gather_by_index(scores, num_samples, self.ctx)
        return replace(old, logp=[p[0] for p in pairs], full=[p[1] for p in pairs] if self.measure_full else None)

    def advantages(self, samples: list[Sample], old: OldScores) -> tuple[torch.Tensor, dict]:
        """GRPO advantages, the reward reduced by ``--kl-coef`` x the summed k1 KL first."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        stats = {}
        if self.optimizer_cfg.kl_coef > 0:
            kl = torch.stack([kl_estimate(f, r, "k1").sum() for f, r in zip(old.full, old.ref)])
            rewards = rewards - self.optimizer_cfg.kl_coef * kl
            stats["kl_reward_penalty"] = float(kl.mean())
        episodes = episode_index(samples)
        if episodes is None:
            return grpo_advantages(
                rewards,
                self.rollout_cfg.n_samples_per_prompt,
                normalize_std=not self.optimizer_cfg.disable_grpo_std_normalization,
            ), stats
        # an agent episode split by a history rewrite is several samples: one advantage per episode
        first = torch.tensor(sorted({e: i for i, e in reversed(list(enumerate(episodes)))}.values()))
        per_episode = grpo_advantages(
            rewards[first],
            self.rollout_cfg.n_samples_per_prompt,
            normalize_std=not self.optimizer_cfg.disable_grpo_std_normalization,
        )
        return per_episode[torch.tensor(episodes)], stats

    # ---- the update ---------------------------------------------------------------------

    def update(
        self, r: int, steps: list[OptimizerStep], trained: list[Sample], old: OldScores, advantages, num_samples: int
    ) -> tuple[UpdateMetrics, OldScores]:
        """Loss, backward and optimizer step per global batch (loss weighted by core/losses.token_weights).
        Fused, the first step's forward ran before any step: its scores are the old policy's."""
        per_step = []
        for step in steps:
            result = self.backward(r, step, trained, old, advantages)
            if old.logp is None:
                old = self.with_fresh_old(old, result.scores, num_samples)
                self._agreement = self._take_agreement()  # fused: this forward was the old policy's
            per_step.append((result.sums, self.optimizer_step(r)))  # stops on a NaN gradient, before the step
        self._take_agreement()  # what later steps' forwards saw is not the old policy's
        metrics = UpdateMetrics.mean(
            per_step,
            self.actor.last_lr,
            self.optimizer_cfg.use_score_centering,
            self.distill_cfg.opd_divergence if self.teacher is not None else None,
        )
        return metrics, old

    def backward(
        self, rollout: int, step: OptimizerStep, samples: list[Sample], old: OldScores, advantages: torch.Tensor
    ) -> BackwardResult:
        """Forward and backward of this rank's micro-batches of one optimizer step."""
        sums, scores = StepSums(), {}
        for batch in step.micro_batches:
            s, f = self._micro_batch(rollout, batch, step, samples, old, advantages)
            sums.add(s)
            scores.update(f)
        # the CP and TP ranks of a micro-batch hold the same loss: count it once
        total = [v / self.layout.replicas for v in all_reduce_sum(list(astuple(sums)), self.ctx)]
        return BackwardResult(StepSums(*total), scores)

    def _micro_batch(
        self, rollout: int, batch: MicroBatch, step: OptimizerStep, samples, old: OldScores, advantages
    ) -> tuple[StepSums, dict]:
        sc = self._update_scorers[self.fused and self.replay and self.measure_full](batch)
        full = sc.full if sc.full is not None else sc.logp
        fresh = dict(
            zip(batch.indices, zip((x.detach() for x in batch.split(sc.logp)), (x.detach() for x in batch.split(full))))
        )
        if old.logp is None:  # fused: this forward runs before any step of the rollout, it is the old policy
            old_logp = sc.logp.detach()
        else:
            old_logp = torch.cat([old.logp[i] for i in batch.indices]).to(sc.logp.device)
        log_mu = (
            torch.cat([torch.from_numpy(samples[i].log_mu) for i in batch.indices]).to(sc.logp.device)
            if self.replay
            else None
        )
        opt = self.optimizer_cfg
        token_advantages = torch.repeat_interleave(
            advantages[batch.indices].to(sc.logp.device), torch.tensor(batch.lengths, device=sc.logp.device)
        )
        distilled = self._distilled(batch, sc, full, old, token_advantages)  # None without --use-opd
        token_advantages = token_advantages if distilled is None else distilled.advantages
        centering = drift = None
        if opt.use_score_centering:  # the sampler-expected score on the replayed support, subtracted
            centering, drift = score_centering_term(
                sc.support_logp, batch.sampler_support_logp, batch.support[1], token_advantages,
                opt.score_centering_weight, opt.tis_cap,
            )  # fmt: skip
        terms = policy_token_loss(
            sc.logp,
            log_mu if self.optimizer_cfg.use_rollout_logprobs else old_logp,
            token_advantages,
            clip_low=self.optimizer_cfg.eps_clip,
            clip_high=self.optimizer_cfg.eps_clip_high,
            importance_weights=importance_weights(
                old_logp, log_mu, self.optimizer_cfg.tis_mode, self.optimizer_cfg.tis_cap
            )
            if self.optimizer_cfg.use_tis
            else None,
            kl=kl_estimate(sc.full, torch.cat([old.ref[i] for i in batch.indices]), self.optimizer_cfg.kl_loss_type)
            if self.optimizer_cfg.use_kl_loss
            else None,
            kl_coef=self.optimizer_cfg.kl_loss_coef,
            entropy=sc.entropy,
            entropy_coef=self.optimizer_cfg.entropy_coef,
            reinforce=(log_mu, opt.score_centering_weight, opt.tis_cap) if opt.policy_loss == "reinforce" else None,
            centering=centering,
        )
        total = terms.total if distilled is None or distilled.loss is None else terms.total + distilled.loss
        refuse_non_finite(total, batch, rollout)  # before backward: nothing of it reaches the weights
        weights = token_weights(
            batch.loss_mask,
            batch.lengths,
            self.optimizer_cfg.loss_aggregation,
            batch_tokens=step.tokens,
            batch_sequences=step.sequences,
        )
        loss = (total * weights).sum()
        self.actor.backward(loss)
        return step_sums(loss, terms, batch.loss_mask, token_advantages, drift, distilled and distilled.sums), fresh

    def _distilled(self, batch: MicroBatch, sc, full: torch.Tensor, old: OldScores, token_advantages):
        """--use-opd: the teacher's divergence on the replayed support (train/distillation.py); the one-sample
        estimate reads the old policy's full-vocabulary log pi(a_t) (fused: this forward's)."""
        if self.teacher is None:
            return None
        student_full_old = (
            full.detach() if old.full is None else torch.cat([old.full[i] for i in batch.indices]).to(full.device)
        )
        return distill_terms(self.distill_cfg, batch, sc.support_logp, student_full_old, old.teacher, token_advantages)

    def optimizer_step(self, rollout: int) -> float:
        """Clip, step, zero the gradients; returns the gradient norm before clipping. A NaN or
        infinite gradient stops the run before the step (nothing pushed or saved)."""
        norm = self.actor.clip_and_step(self.optimizer_cfg.clip_grad)
        if norm is None:
            raise NonFiniteError(
                f"rollout {rollout}: the gradient norm is not finite; the run stops before the optimizer step"
            )
        return norm
