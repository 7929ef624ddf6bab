"""The pieces of a GRPO run, each receiving what it uses; loop.py strings them together."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from ..backends import EngineBackend, SGLangBackend
from ..config import RunConfig
from ..engine import Engine
from ..errors import SupportReplayError
from ..losses import grpo_advantages, kl_estimate, logprob_mismatch_metrics, ppo_token_loss, support_size_metrics, truncated_importance_weights
from ..models import smollm2_checkpoint
from ..rollout import generate_samples, load_prompts, load_reward, validate_sample
from ..rollout.data import ArithmeticTask
from ..sampling import SamplingParams
from .actor import Actor, load_scoring_model, score_samples
from .dist import all_reduce_sum, broadcast_object


class CITestError(SupportReplayError):
    """--ci-test found a token whose trainer log-prob differs from the rollout log mu."""


def gather_by_index(local: dict, n: int, ctx) -> list:
    """Per-sample tensors held by different ranks, as one list in sample order on every rank."""
    if ctx.world > 1:
        import torch.distributed as dist

        parts = [None] * ctx.world
        dist.all_gather_object(parts, {i: tuple(t.cpu() for t in v) for i, v in local.items()})
        local = {i: t for part in parts for i, t in part.items()}
    return [local[i] for i in range(n)]


def _require_deterministic(url: str) -> None:
    import httpx

    info = httpx.get(url.rstrip("/") + "/model_info", timeout=30).json()
    if not info.get("deterministic"):
        raise SupportReplayError(f"--true-on-policy-mode: the engine at {url} is not deterministic; start it with `support-replay serve --deterministic`")


class Trainer:
    def __init__(self, cfg: RunConfig, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.checkpoint_path = Path(cfg.hf_checkpoint) if cfg.hf_checkpoint else (smollm2_checkpoint() if ctx.is_main else None)
        self.checkpoint_path = broadcast_object(self.checkpoint_path, ctx)
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint_path)
        torch.manual_seed(cfg.seed)
        self.actor = Actor(
            self.checkpoint_path, ctx, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
            batch_invariant=cfg.true_on_policy_mode,
        )
        self.vocab_size = self.actor.model.hf.get_output_embeddings().weight.shape[0]
        self.reference = None
        if cfg.needs_reference:
            self.reference = load_scoring_model(self.checkpoint_path, ctx.device).eval().requires_grad_(False)
        self.replay = cfg.use_sampling_support_replay
        self.params = SamplingParams(temperature=cfg.rollout_temperature, top_k=cfg.rollout_top_k, top_p=cfg.rollout_top_p, min_p=cfg.rollout_min_p)
        self.prompts = load_prompts(cfg.prompt_data, cfg.input_key, cfg.label_key, seed=cfg.seed)
        self.eval_prompts = load_prompts(cfg.eval_prompt_data, cfg.input_key, cfg.label_key, seed=cfg.seed + 1) if cfg.eval_interval else None
        self.reward_fn = load_reward(cfg.rm_type, cfg.custom_rm_path)
        self.engine = self.backend = None
        if ctx.is_main:
            if cfg.rollout_url:
                self.backend = SGLangBackend(cfg.rollout_url, self.vocab_size)
                if cfg.true_on_policy_mode:
                    _require_deterministic(cfg.rollout_url)
            else:
                self.engine = Engine.from_pretrained(
                    self.checkpoint_path, semantics=cfg.sampling_semantics, sampling_mask_max_tokens=cfg.sampling_mask_max_tokens,
                    seed=cfg.rollout_seed, deterministic=cfg.true_on_policy_mode,
                )
                self.backend = EngineBackend(self.engine)

    # ---- rollout ----------------------------------------------------------------------

    def _generate(self, prompts, params, n, max_new, capture, rollout, seed):
        samples = None
        if self.ctx.is_main:
            samples = generate_samples(
                self.backend, self.tokenizer, prompts, params=params, n_samples=n, max_new_tokens=max_new, capture=capture,
                reward_fn=self.reward_fn, rollout=rollout, seed=seed, apply_chat_template=self.cfg.apply_chat_template,
            )
        return broadcast_object(samples, self.ctx)

    def rollout(self, r: int):
        cfg = self.cfg
        prompts = [self.prompts[r * cfg.rollout_batch_size + i] for i in range(cfg.rollout_batch_size)]
        samples = self._generate(prompts, self.params, cfg.n_samples_per_prompt, cfg.rollout_max_response_len, self.replay, r, cfg.rollout_seed)
        for s in samples:
            validate_sample(s, self.vocab_size, replay=self.replay, temperature=cfg.rollout_temperature)
        return samples

    def evaluate(self, r: int) -> dict:
        cfg = self.cfg
        task = self.eval_prompts
        offset = 10**6 if isinstance(task, ArithmeticTask) else 0  # held-out questions
        prompts = [task[offset + i] for i in range(min(cfg.n_eval_prompts, len(task)))]
        params = SamplingParams(temperature=cfg.eval_temperature, top_k=cfg.eval_top_k, top_p=cfg.eval_top_p) if cfg.eval_temperature > 0 else SamplingParams(temperature=0.0)
        samples = self._generate(prompts, params, cfg.n_samples_per_eval_prompt, cfg.eval_max_response_len or cfg.rollout_max_response_len, False, r, cfg.rollout_seed + 7)
        return {"eval_reward_mean": float(np.mean([s.reward for s in samples])), "eval_response_len": float(np.mean([s.response_length for s in samples]))}

    # ---- scoring before the update ----------------------------------------------------

    @property
    def fused(self) -> bool:
        """One optimizer step per rollout and no KL reward: the update's own forward, taken
        before the step, gives the old log-probs, so no separate scoring pass is needed."""
        cfg = self.cfg
        return cfg.global_batch_size == cfg.rollout_batch_size * cfg.n_samples_per_prompt and cfg.kl_coef == 0

    @torch.no_grad()
    def score_old(self, samples) -> dict:
        """Scores of the data before any update: old log-probs (unless fused), reference."""
        cfg, mb = self.cfg, self.cfg.micro_batch_size
        old, full, ref = [], [], []
        for i in range(0, len(samples), mb):
            chunk = samples[i : i + mb]
            if not self.fused:
                sc = self.actor.score(chunk, cfg.rollout_temperature, replay=self.replay, full=True)
                old += sc.split(sc.logp)
                full += sc.split(sc.full)
            if self.reference is not None:
                rs = score_samples(self.reference, chunk, cfg.rollout_temperature, replay=False, full=True, device=self.ctx.device)
                ref += rs.split(rs.full)
        return {"old": old or None, "full": full or None, "ref": ref or None}

    def ci_check(self, r: int, samples, old) -> dict:
        """Per-token comparison of the trainer's support log-probs with the rollout log mu
        (bitwise in true-on-policy mode, within --ci-test-tolerance otherwise)."""
        diffs = [np.abs(o.double().cpu().numpy() - s.rollout_logprobs.astype(np.float64)) for s, o in zip(samples, old)]
        flat = np.concatenate(diffs)
        worst = int(np.argmax([d.max() for d in diffs]))
        t = int(np.argmax(diffs[worst]))
        stats = {"train_rollout_logprob_abs_diff_max": float(flat.max()), "train_rollout_logprob_abs_diff_mean": float(flat.mean()), "train_rollout_unequal_tokens": int((flat != 0).sum())}
        tolerance = 0.0 if self.cfg.true_on_policy_mode else self.cfg.ci_test_tolerance
        if self.cfg.ci_test and flat.max() > tolerance:
            s = samples[worst]
            raise CITestError(
                f"--ci-test failed at rollout {r}, sample {s.index}, response position {t}: trainer log pi "
                f"{float(old[worst][t]):.6f} vs rollout log mu {float(s.rollout_logprobs[t]):.6f} "
                f"(|diff| {diffs[worst][t]:.3e} > tolerance {tolerance:g}; {int((flat > tolerance).sum())} tokens over)"
            )
        return stats

    # ---- advantages and the update ----------------------------------------------------

    def advantages(self, samples, scores) -> tuple[torch.Tensor, dict]:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        stats = {}
        if self.cfg.kl_coef > 0:
            kl = torch.stack([kl_estimate(f, r, "k1").sum() for f, r in zip(scores["full"], scores["ref"])])
            rewards = rewards - self.cfg.kl_coef * kl
            stats["kl_reward_penalty"] = float(kl.mean())
        adv = grpo_advantages(rewards, self.cfg.n_samples_per_prompt, normalize_std=not self.cfg.disable_grpo_std_normalization)
        return adv, stats

    def update(self, samples, scores, advantages, on_old_scores=None) -> dict:
        """Optimizer steps over the rollout in global batches; each rank takes its share.

        ``on_old_scores(old)`` receives the pre-update support log-probs of every sample
        before the first optimizer step (the --ci-test hook).
        """
        cfg, ctx = self.cfg, self.ctx
        totals = {"loss": 0.0, "clip_fraction": 0.0, "kl_loss": 0.0, "entropy": 0.0, "grad_norm": 0.0}
        steps = 0
        if not self.fused and on_old_scores is not None:
            on_old_scores(scores["old"])
        for start in range(0, len(samples), cfg.global_batch_size):
            # longest first, so that each micro-batch pads its samples to similar lengths
            batch = sorted(range(start, start + cfg.global_batch_size), key=lambda i: -len(samples[i].prompt_ids) - samples[i].response_length)
            n_tokens = sum(int(samples[i].loss_mask.sum()) for i in batch)
            # contiguous shards: with as many micro-batches per rank, the ranks compute exactly
            # the micro-batches one process would, and the summed gradients agree
            per_rank = -(-len(batch) // ctx.world)
            mine = batch[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
            sums, fresh = np.zeros(5), {}
            for m in range(0, len(mine), cfg.micro_batch_size):
                idx = mine[m : m + cfg.micro_batch_size]
                sums += self._micro_step([samples[i] for i in idx], scores, advantages, idx, n_tokens, len(batch), fresh)
            if self.fused:
                pairs = gather_by_index(fresh, len(samples), ctx)
                scores["old"], scores["full"] = [p[0] for p in pairs], [p[1] for p in pairs]
                if on_old_scores is not None:
                    on_old_scores(scores["old"])
            sums = np.array(all_reduce_sum(list(sums), ctx))
            norm = self.actor.clip_and_step(cfg.clip_grad)
            totals["loss"] += sums[0]
            totals["clip_fraction"] += sums[1] / max(sums[4], 1)
            totals["kl_loss"] += sums[2] / max(sums[4], 1)
            totals["entropy"] += sums[3] / max(sums[4], 1)
            totals["grad_norm"] += norm
            steps += 1
        return {k: v / steps for k, v in totals.items()}

    def _micro_step(self, chunk, scores, advantages, idx, n_tokens: int, n_samples: int, fresh: dict) -> np.ndarray:
        cfg = self.cfg
        sc = self.actor.score(
            chunk, cfg.rollout_temperature, replay=self.replay, full=cfg.use_kl_loss, entropy=cfg.entropy_coef > 0, full_detached=self.fused and self.replay
        )
        if self.fused:  # this forward runs before any step of this rollout: it is the old policy
            full = sc.full if sc.full is not None else sc.logp  # without replay the score is the full one
            fresh.update(zip(idx, zip((x.detach() for x in sc.split(sc.logp)), (x.detach() for x in sc.split(full)))))
            scores = {**scores, "old": {i: fresh[i][0] for i in idx}}
        old = torch.cat([self._old(scores, chunk, i, j) for j, i in enumerate(idx)])
        mask = torch.cat([torch.from_numpy(s.loss_mask.astype(np.float32)) for s in chunk])
        adv = torch.cat([advantages[i].expand(s.response_length) for i, s in zip(idx, chunk)])
        per_token, clipped = ppo_token_loss(sc.logp, old, adv, cfg.eps_clip, cfg.eps_clip_high)
        if cfg.use_tis:
            rollout = torch.cat([torch.from_numpy(s.rollout_logprobs) for s in chunk])
            per_token = per_token * truncated_importance_weights(old, rollout, cfg.tis_cap)
        kl = torch.zeros_like(per_token)
        if cfg.use_kl_loss:
            ref = torch.cat([scores["ref"][i] for i in idx])
            kl = kl_estimate(sc.full, ref, cfg.kl_loss_type)
            per_token = per_token + cfg.kl_loss_coef * kl
        if sc.entropy is not None:
            per_token = per_token - cfg.entropy_coef * sc.entropy
        if cfg.loss_aggregation == "token":
            weights = mask / n_tokens
        else:
            weights = torch.cat([torch.full((s.response_length,), 1.0 / (max(float(s.loss_mask.sum()), 1.0) * n_samples)) for s in chunk]) * mask
        loss = (per_token * weights).sum()
        self.actor.backward(loss)
        with torch.no_grad():
            ent = sc.entropy if sc.entropy is not None else torch.zeros_like(per_token)
            return np.array([float(loss), float((clipped.float() * mask).sum()), float((kl * mask).sum()), float((ent * mask).sum()), float(mask.sum())])

    def _old(self, scores, chunk, i: int, j: int) -> torch.Tensor:
        if self.cfg.use_rollout_logprobs:
            return torch.from_numpy(chunk[j].rollout_logprobs.astype(np.float32))
        return scores["old"][i]

    # ---- after the update -------------------------------------------------------------

    def rollout_metrics(self, samples, scores) -> dict:
        rewards = [s.reward for s in samples]
        out = {
            "reward_mean": float(np.mean(rewards)),
            "response_len_mean": float(np.mean([s.response_length for s in samples])),
            "truncated_share": float(np.mean([s.status == "truncated" for s in samples])),
        }
        if self.replay:
            out.update(support_size_metrics(np.concatenate([s.support.sizes() for s in samples])))
            rollout = torch.cat([torch.from_numpy(s.rollout_logprobs) for s in samples])
            ones = torch.ones_like(rollout)
            if scores["full"] is not None:  # what a full-vocabulary scorer would have made of the ratio
                m = logprob_mismatch_metrics(torch.cat(scores["full"])[None], rollout[None], ones[None])
                out["full_vocab_ratio_mean"] = m["ratio_mean"]
                out["full_vocab_ratio_outside_10pct"] = m["ratio_outside_10pct"]
            replay = logprob_mismatch_metrics(torch.cat(scores["old"])[None], rollout[None], ones[None])
            out["replay_ratio_mean"] = replay["ratio_mean"]
            out["mismatch_kl"] = replay["mismatch_kl"]
        return out

    def timed(self, name: str, timings: dict, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        timings[f"time_{name}"] = time.perf_counter() - start
        return result
