"""``support-replay audit``: sample from the run's rollout source, score every token with the trainer's
forward, split the log-ratio by cause, look for settings drift, and certify (docs/audit.md).

The audit reads the run's flags as ``train`` does and uses them where ``train`` would: the rollout
source (``--rollout-url`` / ``--rollout-engine`` or the in-process engine), the checkpoint, the
prompts, the sampling settings, the trainer's dtype, kernels and micro-batches. Its client sends
only the sampling settings that differ from the API's neutral value, as a user's client does
(``--send-neutral-sampling-settings`` sends them all, as the trainer does). It never pushes weights.
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from .. import __version__
from ..backends.kind import EngineKind
from ..backends.registry import kind_for
from ..errors import ConfigError, SamplerMismatch
from ..protocol import DEFAULT_WEIGHT_VERSION
from ..rollout import generate_samples, load_prompts, load_reward
from ..rollout.generate import Asked, OnFailure
from ..train.actor import Actor
from ..train.batches import plan_optimizer_steps
from ..train.config import RunConfig
from ..train.dist import close_distributed, init_distributed
from ..train.loop import deterministic_mode
from . import findings as find
from . import report as rep
from .collect import score_samples
from .settings import AuditSettings, declared_sampling, sent_fields


def _refuse(cfg: RunConfig) -> None:
    if cfg.parallel.split:
        raise ConfigError(
            f"--{cfg.parallel.split.replace('_', '-')}: the audit scores in one process (the sharded forward equals "
            "it, tests/train/test_parallel*.py); drop the flag"
        )
    if cfg.agents.enabled:
        raise ConfigError(
            "--agent / --agent-path: the audit samples single-turn prompts; audit the engine without them"
        )
    if not cfg.use_sampling_support_replay and not kind_for(cfg.engine).reveals_whole_support:
        raise ConfigError(
            f"--rollout-top-k={cfg.rollout_top_k} --rollout-top-p={cfg.rollout_top_p} --rollout-min-p="
            f"{cfg.rollout_min_p}: the declared settings keep the whole vocabulary, a support only vLLM's processed "
            "log-probs reveal (--rollout-engine vllm); declare a top_k for the other engines"
        )


def _generate(cfg: RunConfig, backend, tokenizer, sent):
    data, rollout = cfg.data, cfg.rollout
    task = load_prompts(
        data.prompt_data, data.input_key, data.label_key, seed=cfg.optimizer.seed, max_operand=data.max_operand
    )
    prompts = [task[i] for i in range(min(rollout.rollout_batch_size, len(task)))]
    asked = Asked(
        rollout.sampling_params,
        n_samples=rollout.n_samples_per_prompt,
        max_new_tokens=rollout.rollout_max_response_len,
        capture=True,
        penalties=rollout.penalties,
        ignore_eos=rollout.rollout_ignore_eos,
        routing=cfg.replay.use_rollout_routing_replay,
        sent_sampling_fields=sent,
        apply_chat_template=data.apply_chat_template,
    )
    on_failure = OnFailure(cfg.production.failed_group_policy, cfg.production.max_regenerations)
    return generate_samples(
        backend,
        tokenizer,
        prompts,
        asked,
        reward_fn=load_reward(data.rm_type, data.custom_rm_path),
        rollout=0,
        seed=rollout.rollout_seed,
        rid_prefix=f"audit-{uuid.uuid4().hex[:12]}",
        on_failure=on_failure,
    )[0]


def run_audit(cfg: RunConfig, settings: AuditSettings) -> dict:
    """Sample, score, split, check; write ``audit.json`` and ``audit.png`` to ``--output-dir``; the report."""
    _refuse(cfg)
    ctx = init_distributed()
    try:
        with deterministic_mode(cfg.replay.deterministic_mode):  # the trainer's kernels, as train chooses them
            return _audit(cfg, settings, ctx)
    finally:
        close_distributed(ctx)


@dataclass
class Setup:
    """What an audit runs on: the trainer's actor, the rollout source and what it says of itself."""

    checkpoint: Path
    actor: Actor
    kernel: str
    backend: object
    kind: EngineKind  # connected; holds the in-process engine where it is one
    identity: dict
    semantics: str  # the filter and penalty semantics the engine samples with


def _set_up(cfg: RunConfig, settings: AuditSettings, ctx) -> Setup:
    from ..modeling.checkpoints import smollm2_checkpoint

    checkpoint = Path(cfg.data.hf_checkpoint) if cfg.data.hf_checkpoint else smollm2_checkpoint()
    kernel = cfg.trainer_linear_kernel(ctx.device)
    actor = Actor.for_run(  # the trainer's model as train builds it
        checkpoint, ctx, rollout=cfg.rollout, optimizer=cfg.optimizer, replay=cfg.replay, linear_kernel=kernel
    )
    kind = kind_for(cfg.engine, cfg.in_process_engine(checkpoint))
    identity = kind.identity()
    semantics = kind.penalty_semantics(cfg.rollout.penalties, identity["semantics"])
    cfg.rollout.penalties.check(semantics, actor.vocab_size, where="the run's penalties")
    needs = cfg.engine_needs(
        actor.vocab_size, DEFAULT_WEIGHT_VERSION, actor.routing_shape, vllm_max_logprobs=settings.vllm_max_logprobs
    )
    backend = kind.connect(needs)
    return Setup(checkpoint, actor, kernel, backend, kind, identity, semantics)


def _audit(cfg: RunConfig, settings: AuditSettings, ctx) -> dict:
    from transformers import AutoTokenizer

    setup = _set_up(cfg, settings, ctx)
    declared = declared_sampling(cfg.rollout)
    sent = sent_fields(declared, settings.send_neutral_sampling_settings)
    max_kl, max_abs = settings.thresholds(cfg.replay)
    report = {
        "report_version": rep.REPORT_VERSION,
        "tool": {"name": "support-replay audit", "version": __version__},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "engine": setup.identity,
        "checkpoint": str(setup.checkpoint),
        "thresholds": {"max_mismatch_kl": max_kl, "max_abs_logprob_diff": max_abs},
        "settings": {"declared": declared, "sent": sorted(sent), "semantics": setup.semantics},
    }
    try:
        samples = _generate(cfg, setup.backend, AutoTokenizer.from_pretrained(setup.checkpoint), sent)
    except SamplerMismatch as exc:  # the engine says it sampled with other settings: fail closed, by name
        report["error"] = str(exc)
        report["findings"] = [find.Finding("sampler", f"the engine's sampler record disagrees: {exc}", 0, []).to_json()]
        report["verdict"] = {"pass": False, "reasons": [f"sampler: {exc}"]}
        rep.write_json(report, cfg.output.output_dir)
        return report
    finally:
        setup.kind.close()
    score = _scoring(cfg, setup, samples, ctx)
    scores = score(cfg.rollout.sampling_params)
    replay = cfg.use_sampling_support_replay
    parts = rep.causes(scores, replay)
    report.update(
        trainer={
            "dtype": cfg.train_dtype,
            "linear_kernel": setup.kernel,
            "head": score.head,
            "replay": replay,
            "true_on_policy_mode": cfg.true_on_policy_mode,
        },
        samples=len(samples),
        tokens=int(len(scores.sample)),
        causes=rep.cause_figures(parts, scores.full - scores.log_mu),
        head_residual=rep.head_residual(scores, replay),
        scorings=rep.scorings(scores, replay, cfg.rollout.penalties.active, max_kl, max_abs),
    )
    report["settings"]["observed"] = {"support": rep.support_figures(scores), "sampler_records": _records(samples)}
    found = _findings(cfg, settings, report, samples, scores, parts, score, setup.actor.vocab_size)
    report["routing"] = _routing(cfg, scores)
    report["findings"] = [f.to_json() for f in found]
    report["worst_tokens"] = {k: rep.worst_tokens(scores, parts, k) for k in ("total", "numerics")}
    passed, reasons = rep.verdict(report)
    report["verdict"] = {"pass": passed, "reasons": reasons}
    rep.write(report, {"total": scores.full - scores.log_mu, **parts}, cfg.output.output_dir)
    return report


def _scoring(cfg: RunConfig, setup: Setup, samples, ctx):
    """``score(params) -> TokenScores``: the trainer's forward over the samples in the run's micro-batches,
    the filter evidence read against ``params`` (where it can be: no penalties)."""
    steps = plan_optimizer_steps(
        samples,
        global_batch=len(samples),
        micro_batch=cfg.parallel.micro_batch,
        rank=0,
        world=1,
        replay=True,  # every batch carries its support, also where the trainer scores the full vocabulary
        device=ctx.device,
        penalty_semantics=setup.semantics,
        max_tokens=cfg.parallel.max_tokens_per_micro_batch,
        pack=cfg.pack_groups,
    )
    trainer_scorer = setup.actor.scorer(cfg.rollout_temperature)
    evidence = not cfg.rollout.penalties.active  # penalised supports are not comparable with the model's filter

    def score(params):
        return score_samples(setup.actor, trainer_scorer, steps, samples, params, setup.semantics, evidence)

    score.head, score.evidence = trainer_scorer.head, evidence
    return score


def _findings(cfg, settings, report, samples, scores, parts, score, vocab: int) -> list:
    """Temperature first: where log mu says the engine sampled at another temperature, the supports are
    compared with the declared filters at that temperature, so that what is found there is what remains."""
    found = []
    temperature, figures = find.temperature_finding(scores, cfg.rollout_temperature)
    report["settings"]["observed"]["temperature"] = figures
    found += [temperature] if temperature else []
    if score.evidence:
        compared, declared, numerics = scores, dict(report["settings"]["declared"]), parts["numerics"]
        if temperature is not None:  # the numerics there are what log mu leaves unexplained at that temperature
            declared["temperature"] = figures["fitted"]
            compared = score(replace(cfg.rollout.sampling_params, temperature=figures["fitted"]))
            numerics = find.residuals(scores, figures["fitted"])
        margin = find.margin_of(numerics)
        drift, flips = find.filter_findings(compared, declared, vocab, margin)
        if temperature is not None:
            at = f" (supports compared at the fitted temperature {figures['fitted']:.4f})"
            drift = [replace(f, evidence=f.evidence + at) for f in drift]
        found += drift
        report["boundary_flips"] = {
            "checked": True,
            "temperature": declared["temperature"],
            "tokens": int(flips.sum()),
            "share": float(flips.mean()),
            "margin": margin,
            "examples": find.examples(compared, flips),
        }
    else:
        report["boundary_flips"] = {
            "checked": False,
            "why": "the supports were filtered on penalised logits; the filters are compared on the model's own",
        }
    stale, report["staleness"] = find.staleness(samples, settings.expected_weight_version)
    return found + ([stale] if stale else [])


def _routing(cfg: RunConfig, scores) -> dict:
    if not cfg.use_rollout_routing_replay:
        return {"replayed": False}
    same, compared = scores.routing
    return {
        "replayed": True,
        "choices_compared": compared,
        "agreement": same / compared if compared else None,
        "choices_differing": compared - same,
    }


def _records(samples) -> list[dict]:
    """The distinct sampler records the engine sent (our serve; SGLang and vLLM send none)."""
    seen = []
    for s in samples:
        record = s.metadata.get("sampler")
        if record is not None and record not in seen:
            seen.append(record)
    return seen


def summary(report: dict) -> str:
    """The console table of a report."""
    lines = [
        f"support-replay audit: {report['engine'].get('name')} {report['engine'].get('version') or ''} "
        f"({report.get('samples', 0)} samples, {report.get('tokens', 0)} tokens)"
    ]
    if "causes" in report:
        lines += ["", "| cause | mean | mean abs | max abs | share |", "|---|---:|---:|---:|---:|"]
        for name in ("total", *rep.CAUSES):
            c = report["causes"][name]
            share = f"{c['share']:.1%}" if "share" in c else ""
            lines.append(f"| {name} | {c['mean']:.3e} | {c['mean_abs']:.3e} | {c['max_abs']:.3e} | {share} |")
        lines += ["", "| scoring | mismatch KL | max abs diff | ratio mean | pass |", "|---|---:|---:|---:|---|"]
        for name, m in report["scorings"].items():
            lines.append(
                f"| {name} | {m['mismatch_kl']:.3e} | {m['abs_diff_max']:.3e} | {m['ratio_mean']:.4f} | "
                f"{'pass' if m['pass'] else 'FAIL'} |"
            )
    for f in report.get("findings", []):
        lines.append(f"finding {f['setting']}: {f['evidence']}")
    verdict = report["verdict"]
    lines.append("")
    lines.append("PASS" if verdict["pass"] else "FAIL: " + "; ".join(verdict["reasons"]))
    return "\n".join(lines)
