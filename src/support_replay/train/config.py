"""RunConfig: every setting of a training run, in sections, and the rules that join sections
(docs/contract.md).

A run's config is made of small frozen sections (train/sections.py), each validated where it is
defined; components take the sections they use. Flags follow the RL frameworks of the field
(slime / Miles style): each field ``foo_bar`` of a section is ``--foo-bar`` on the command line,
booleans are switches, ``--help`` groups them by section. A YAML file (``--config``) gives
defaults that flags override; the config a run writes (``config.json``) has the same flat keys,
so ``--config`` reads it back. ``RunConfig(**flat)`` builds one from flag names and validates it:
a setting that is invalid, or that replay cannot honour, raises ``ConfigError`` naming the flag
and the value. ``use_sampling_support_replay`` is derived from the rollout sampling settings and
cannot be set. ``cfg.foo_bar`` reads a flag's value wherever it lives.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..backends.registry import kind_class, kind_name
from ..errors import ConfigError
from ..modeling.linear_kernels import resolve_linear_kernel
from .distillation_config import check_distillation
from .schedule import warmup_steps
from .section_base import bad, flag
from .sections import (
    BF16_CI_TOLERANCE,
    FP32_CI_TOLERANCE,
    MAX_DEFAULT_MICRO_BATCH,
    SECTIONS,
    AgentConfig,
    DataConfig,
    DistillationConfig,
    EngineConfig,
    EvalConfig,
    LaunchConfig,
    OptimizerConfig,
    OutputConfig,
    ParallelConfig,
    ProductionConfig,
    ReplayConfig,
    RolloutConfig,
)

__all__ = [
    "BF16_CI_TOLERANCE",
    "FP32_CI_TOLERANCE",
    "MAX_DEFAULT_MICRO_BATCH",
    "RunConfig",
    "add_run_flags",
    "config_from_args",
    "field_flags",
    "flag_table",
]

FIELD_SECTION = {name: section for section, cls in SECTIONS.items() for name in cls.model_fields}
DERIVED = {  # values a section computes, readable by name like a flag's
    "use_sampling_support_replay": "rollout",
    "sampling_params": "rollout",
    "penalties": "rollout",
    "micro_batch": "parallel",
    "needs_reference": "optimizer",
    "ci_tolerance": "replay",
}
_flag = flag


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    production: ProductionConfig = Field(default_factory=ProductionConfig)
    agents: AgentConfig = Field(default_factory=AgentConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    def __init__(self, **values):
        try:
            super().__init__(**_with_global_batch(_by_section(values)))
        except ValidationError as exc:
            raise ConfigError(describe_validation(exc)) from None

    def __getattr__(self, name: str):
        section = FIELD_SECTION.get(name) or DERIVED.get(name)
        if section is not None:
            return getattr(getattr(self, section), name)
        return super().__getattr__(name)

    def flat(self) -> dict:
        """Every setting under its flag's name (and the derived replay switch), section by section."""
        return {k: v for name in SECTIONS for k, v in getattr(self, name).model_dump().items()}

    def trainer_linear_kernel(self, device) -> str:
        """The trainer's forward products outside true-on-policy mode (which runs the invariant product on both sides,
        kernels/invariant.py), resolved for its compute dtype; tensor-parallel layers (DTensor weights) keep
        ``F.linear``; ``auto`` takes the product measured faster at a trainer's row counts (modeling/kernel_probe.py),
        which may not be the engine's: outside true-on-policy mode nothing promises that the two sides' logits
        agree bit for bit."""
        import torch

        if self.replay.true_on_policy_mode:
            return "invariant"
        if self.parallel.tensor_model_parallel_size > 1:
            return "torch"
        return resolve_linear_kernel(
            self.replay.linear_kernel, getattr(torch, self.replay.train_dtype), device, "train"
        )

    def in_process_engine(self, checkpoint):
        """What this run's in-process engine is built from (the engine kind without --rollout-url)."""
        from ..backends.in_process import InProcessEngine
        from ..engine.settings import EngineSettings

        rollout, replay = self.rollout, self.replay
        settings = EngineSettings(
            semantics=rollout.sampling_semantics,
            sampling_mask_max_tokens=rollout.sampling_mask_max_tokens,
            seed=rollout.rollout_seed,
            linear_kernel=replay.linear_kernel,
            decode_attention=replay.decode_attention,  # the deterministic engine keeps its own attention
            max_total_tokens=self.engine.max_total_tokens,
            deterministic=replay.true_on_policy_mode,
        )
        if self.engine.max_running_requests is not None:
            settings = settings.but(limits=replace(settings.limits, max_batch_size=self.engine.max_running_requests))
        return InProcessEngine(Path(checkpoint), replay.rollout_dtype, settings)

    def engine_needs(self, vocab_size: int, weight_version: str, routing_shape=None, **more):
        """What this run asks of its engine when it connects (``backends/kind.Needs``)."""
        from ..backends.kind import Needs

        replay = self.replay
        return Needs(
            vocab_size,
            weight_version,
            routing_shape=routing_shape,
            true_on_policy_dtype=replay.train_dtype if replay.true_on_policy_mode else None,
            adapter=self.engine.lora_sync == "adapter",
            **more,
        )

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps: ``--num-rollout`` x the global batches of a rollout."""
        rollout = self.rollout
        return rollout.num_rollout * (
            rollout.rollout_batch_size * rollout.n_samples_per_prompt // self.parallel.global_batch_size
        )

    @property
    def lr_schedule(self) -> dict | None:
        """The learning-rate schedule's settings in optimizer steps (``train/schedule.lr_scheduler``'s keywords),
        or None where the rate never changes."""
        opt, total = self.optimizer, self.optimizer_steps
        warmup = warmup_steps(total, opt.lr_warmup_iters, opt.lr_warmup_fraction)
        if warmup < 2 and opt.lr_decay_style == "constant":
            return None
        end = opt.lr_decay_iters if opt.lr_decay_iters is not None else total
        return dict(lr=opt.lr, warmup=warmup, decay_style=opt.lr_decay_style, decay_end=end, min_lr=opt.min_lr)

    @property
    def pack_groups(self) -> bool:
        """Packed scoring: asked for, or by default wherever it composes (see ``_packing_conflict``)."""
        mode = self.parallel.packed_scoring
        return mode == "on" or (mode == "auto" and self._packing_conflict() is None)

    def _packing_conflict(self) -> str | None:
        """Why packed rows cannot serve this run, or None."""
        if self.rollout.penalties.active:
            return "penalties and logit bias are replayed over each sequence's own history, one sequence per row"
        if self.parallel.context_parallel_size > 1:
            return "context parallelism splits one sequence per row by position"
        if self.replay.attn_implementation != "sdpa":
            return (
                "packed rows take each sequence's keys apart in the sdpa attention, not in "
                f"{self.replay.attn_implementation}"
            )
        return None

    # ---- rules that join sections (each section checks its own) ----------------------

    @model_validator(mode="after")
    def _fail_closed(self):
        """docs/contract.md: each rejection names the flag and the value."""
        self._check_replay()
        self._check_batches()
        self._check_schedule()
        self._check_parallel()
        self._check_production()
        self._check_agents()
        self._check_launch()
        self._check_lora_sync()
        check_distillation(self.distillation, self.rollout, self.parallel, self.optimizer)
        return self

    def _check_replay(self) -> None:
        rollout, replay, engine = self.rollout, self.replay, self.engine
        on = rollout.use_sampling_support_replay
        needs_replay = "which only replay captures (rollout top_p < 1, top_k > 0 or min_p > 0)"
        if replay.ci_test and not on:
            bad("ci_test", True, f"compares the trainer's log-probs with the rollout log mu, {needs_replay}")
        if replay.true_on_policy_mode and rollout.sampling_semantics == "hf":
            bad(
                "sampling_semantics",
                "hf",
                "true-on-policy mode needs a deterministic sampler (sglang or vllm); hf ties depend on the batch",
            )
        kind = kind_class(kind_name(engine))
        if replay.true_on_policy_mode and not kind.deterministic:
            bad(
                "rollout_engine",
                engine.rollout_engine,
                "true-on-policy mode needs our batch-invariant engine (support-replay serve --deterministic)",
            )
        if self.optimizer.policy_loss == "reinforce" and not on:
            bad("policy_loss", "reinforce", f"weights by the sampler's log mu on the replayed support, {needs_replay}")
        if self.optimizer.use_score_centering and not on:
            bad("use_score_centering", True, f"centres the score on the replayed support, {needs_replay}")
        refused = kind.refusal(engine, score_centering=self.optimizer.use_score_centering)
        if refused:
            bad(*refused)
        if replay.min_support_mass > 0 and not on:
            bad(
                "min_support_mass",
                replay.min_support_mass,
                f"measures the mass inside the replayed supports, {needs_replay}",
            )
        if replay.min_support_mass > 0 and rollout.penalties.active:
            bad(
                "min_support_mass",
                replay.min_support_mass,
                "the support mass is measured on the model's own distribution; with penalties the support was "
                "filtered on penalised logits",
            )

    def _check_batches(self) -> None:
        rollout, parallel = self.rollout, self.parallel
        total = rollout.rollout_batch_size * rollout.n_samples_per_prompt
        if total % parallel.global_batch_size:
            bad(
                "global_batch_size",
                parallel.global_batch_size,
                f"must divide rollout_batch_size x n_samples_per_prompt = {total}",
            )
        whole_groups = parallel.global_batch_size % rollout.n_samples_per_prompt == 0
        for name, value in (
            ("failed_group_policy", self.production.failed_group_policy),
            ("stale_sample_policy", self.production.stale_sample_policy),
        ):
            if value == "drop" and not whole_groups:
                bad(
                    name,
                    "drop",
                    f"drops whole groups, so --global-batch-size={parallel.global_batch_size} must be a multiple "
                    f"of --n-samples-per-prompt={rollout.n_samples_per_prompt}",
                )

    def _check_schedule(self) -> None:
        schedule = self.lr_schedule
        if schedule and schedule["decay_style"] != "constant" and schedule["decay_end"] <= schedule["warmup"]:
            bad(
                "lr_decay_iters",
                schedule["decay_end"],
                f"the decay must end after the {schedule['warmup']} warmup steps (the run has "
                f"{self.optimizer_steps} optimizer steps)",
            )

    def _check_parallel(self) -> None:
        split = self.parallel.split
        if self.optimizer.lora_rank and split:
            bad(
                split,
                getattr(self.parallel, split),
                "LoRA trains under FSDP2 data parallelism; peft's layers are not split by the tensor- and "
                "context-parallel plans (not built): drop the flag or --lora-rank",
            )
        if self.optimizer.lora_rank and self.replay.true_on_policy_mode:
            bad(
                "lora_rank",
                self.optimizer.lora_rank,
                "true-on-policy mode needs the trainer's bits to be the engine's, and the engine runs the merged "
                "weights (W + BA) while the trainer runs W x + B A x: their rounding differs",
            )
        if split and self.rollout.penalties.active:
            bad(
                split,
                getattr(self.parallel, split),
                "penalties are replayed on whole support rows of one rank; tensor and context parallelism "
                "do not split them yet",
            )
        if split and self.replay.true_on_policy_mode:
            bad(
                split,
                getattr(self.parallel, split),
                "true-on-policy mode needs the engine's batch-invariant kernels, which run on one rank",
            )
        if self.parallel.context_parallel_size > 1 and self.replay.attn_implementation != "sdpa":
            bad(
                "attn_implementation",
                self.replay.attn_implementation,
                "context parallelism runs its own attention over the gathered keys and values",
            )
        if self.parallel.packed_scoring == "on" and self._packing_conflict():
            bad("packed_scoring", "on", f"{self._packing_conflict()}: use --packed-scoring off or auto")

    def _check_lora_sync(self) -> None:
        engine = self.engine
        if engine.lora_sync != "adapter":
            return
        remote = engine.rollout_url or self.launch.starts_engines
        why = None
        if not self.optimizer.lora_rank:
            why = "sends the LoRA adapter: needs --lora-rank"
        elif not remote:
            why = "the in-process engine takes the merged weights in memory: needs --rollout-url (or started engines)"
        elif engine.weight_transport == "http":
            why = (
                "the adapter is loaded from a directory the engine reads (SGLang's lora_path): --weight-transport disk"
            )
        elif self.production.async_rollout:
            why = (
                "swaps the adapter by an unload and a load (SGLang refuses to load a loaded name), between which a "
                "request in flight fails; --async-rollout has requests in flight at every push"
            )
        if why:
            bad("lora_sync", "adapter", why)

    def _check_production(self) -> None:
        production = self.production
        mode = self.engine.weight_sync_mode
        if mode == "in_place" and self.replay.true_on_policy_mode:
            bad(
                "weight_sync_mode",
                mode,
                "keeps the old weights' keys and values under the new weights, so the tokens after a push are not "
                "sampled from the trained policy exactly; --true-on-policy-mode needs --weight-sync-mode retract "
                "(recomputed under the new weights) or wait",
            )
        if production.partial_rollout:
            self._check_partial_rollout()
        if mode == "in_place" and self.replay.use_rollout_routing_replay:
            bad(
                "weight_sync_mode",
                mode,
                "keeps the old weights' keys and values, computed with their routing, under the new weights: no "
                "forward of the trainer routes and computes a prefix that way, so the tokens after a push cannot be "
                "replayed; --weight-sync-mode retract recomputes the prefix (each token is then scored under the "
                "routing that computed it)",
            )
        regenerates = production.failed_group_policy == "regenerate" and production.max_regenerations >= 1
        if production.async_rollout and self.engine.weight_sync_mode == "abort" and not regenerates:
            bad(
                "weight_sync_mode",
                "abort",
                "with --async-rollout every push aborts the rollout in flight, whose groups must then be "
                "generated again: needs --failed-group-policy regenerate and --max-regenerations >= 1",
            )

    def _check_partial_rollout(self) -> None:
        over = self.production.over_sampling_batch_size
        if over is not None and over < self.rollout.rollout_batch_size:
            bad(
                "over_sampling_batch_size",
                over,
                f"sends fewer groups than the --rollout-batch-size {self.rollout.rollout_batch_size} a rollout trains",
            )
        why = None
        if self.agents.enabled:
            why = "with agents: an episode's turns are not stopped and continued (slime refuses it for its agents too)"
        elif kind_name(self.engine) == "vllm":
            why = "with vLLM: its stopped requests' answers are not read here; SGLang, our serve, or in process"
        elif self.output.resume:
            why = (
                "with --resume: the kept groups and the place in the prompts are not in the checkpoint yet, so their "
                "tokens would be lost and prompts sent again"
            )
        if why:
            bad("partial_rollout", True, why)

    def _check_agents(self) -> None:
        agents = self.agents
        if self.rollout.rollout_ignore_eos and agents.enabled:
            bad(
                "rollout_ignore_eos",
                True,
                "an agent's turns end at end-of-sequence; fixed-length responses are for single-turn rollouts",
            )
        if agents.agent and self.data.prompt_data:
            bad(
                "prompt_data",
                self.data.prompt_data,
                f"the built-in agent {agents.agent!r} brings its own tasks; use --agent-path for your own data",
            )

    def _check_launch(self) -> None:
        launch, engine = self.launch, self.engine
        if not launch.starts_engines:
            return
        per = launch.rollout_num_gpus_per_engine
        if engine.rollout_url:
            bad("rollout_url", engine.rollout_url, f"--rollout-num-gpus-per-engine={per} starts the engines itself")
        if not kind_class(engine.rollout_engine).started_by_launcher:
            bad(
                "rollout_engine",
                engine.rollout_engine,
                "the engines this run starts speak the protocol of their server (--launch-server: serve and SGLang "
                "speak SGLang's, vllm vLLM's)",
            )
        if engine.max_total_tokens is not None:
            bad(
                "max_total_tokens",
                engine.max_total_tokens,
                "bounds the in-process engine; the started engines take --sglang-max-total-tokens or "
                "--sglang-mem-fraction-static",
            )
        if launch.launch_server == "support-replay" and per > 1:
            bad(
                "rollout_num_gpus_per_engine",
                per,
                "support-replay serve runs an engine in one process (no tensor parallelism): give 1, or "
                "--launch-server sglang on a machine with SGLang and its GPUs",
            )
        server = launch.launch_server
        if server != "support-replay" and self.replay.true_on_policy_mode:
            bad(
                "launch_server",
                server,
                "true-on-policy mode checks the engine runs our batch-invariant kernels (support-replay serve "
                f"--deterministic); {'SGLang' if server == 'sglang' else 'vLLM'}'s inference is not bitwise with this "
                "trainer",
            )
        if server == "support-replay" and launch.launch_python is not None:
            bad(
                "launch_python",
                launch.launch_python,
                "names the Python of SGLang's or vLLM's server: --launch-server sglang or vllm",
            )
        if server != "support-replay" and engine.weight_transport == "http":
            bad(
                "weight_transport",
                "http",
                "SGLang loads weights from a directory (/update_weights_from_disk)"
                if server == "sglang"
                else "vLLM loads weights from a directory (/collective_rpc reload_weights)",
            )
        if server == "vllm" and launch.sglang_server_args:
            first = launch.sglang_server_args[0].split("=", 1)[0]
            bad(
                "launch_server",
                "vllm",
                f"{first} is a flag of SGLang's server; give vLLM's server flags as --vllm-* "
                "(--vllm-max-model-len 4096)",
            )
        launch.engine_count(self.parallel.actor_ranks or 1, engine.colocate)  # refuses a count that does not divide

    def with_rollout_url(self, url: str, engines: int) -> RunConfig:
        """This run with the ``engines`` it started behind ``url``: rollouts through it, as with ``--rollout-url``,
        ``--sglang-server-concurrency`` requests in flight per engine (Miles' client)."""
        # --max-running-requests went to the command line of the engines it started (engine_command's
        # --max-batch-size); the trainer, a client of theirs now, has no engine to bound
        values = {
            k: v
            for k, v in self.flat().items()
            if k not in DERIVED and k not in LaunchConfig.model_fields and k != "max_running_requests"
        }
        concurrency = self.launch.sglang_server_concurrency * engines
        return RunConfig(
            **{
                **values,
                "rollout_url": url,
                "colocate": False,
                "rollout_engine": "vllm" if self.launch.launch_server == "vllm" else "sglang",
                "rollout_concurrency": concurrency,
            }
        )

    def save_effective(self, directory: str | Path) -> Path:
        """``config.json`` under its flat flag names: ``--config`` reads it back."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.flat(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def _by_section(values: dict) -> dict:
    """Flat flag names (and whole sections) into one dict per section; an unknown name is refused."""
    out: dict = {}
    for name, value in values.items():
        if name in SECTIONS:
            given = value.model_dump(include=set(type(value).model_fields)) if isinstance(value, BaseModel) else value
            out.setdefault(name, {}).update(dict(given))
        elif name in FIELD_SECTION:
            out.setdefault(FIELD_SECTION[name], {})[name] = value
        elif name in DERIVED:
            raise ConfigError(
                f"{flag(name)}={value!r}: is derived from the rollout sampling settings and cannot be set"
            )
        else:
            raise ConfigError(f"{flag(name)}={value!r}: unknown setting")
    return out


def _with_global_batch(sections: dict) -> dict:
    """--global-batch-size as Miles and slime derive it (their arguments.py): rollout_batch_size x
    n_samples_per_prompt / --num-steps-per-rollout, one step per rollout by default; given both, they must agree."""
    rollout, parallel = sections.get("rollout", {}), sections.setdefault("parallel", {})
    defaults = RolloutConfig.model_fields
    prompts = rollout.get("rollout_batch_size", defaults["rollout_batch_size"].default)
    group = rollout.get("n_samples_per_prompt", defaults["n_samples_per_prompt"].default)
    given, steps = parallel.get("global_batch_size"), parallel.get("num_steps_per_rollout")
    try:
        prompts, group, steps = int(prompts), int(group), None if steps is None else int(steps)
    except (TypeError, ValueError):
        return sections  # the sections' own checks name the value
    if steps is None or steps < 1:
        if given is None:
            parallel["global_batch_size"] = prompts * group
        return sections
    if (prompts * group) % steps:
        total = prompts * group
        raise ConfigError(
            f"--num-steps-per-rollout={steps}: must divide rollout_batch_size x n_samples_per_prompt = {total}"
        )
    derived = prompts * group // steps
    if given is not None and given != derived:
        raise ConfigError(
            f"--global-batch-size={given}: differs from rollout_batch_size x n_samples_per_prompt / "
            f"--num-steps-per-rollout = {derived}; give one of them"
        )
    parallel["global_batch_size"] = derived
    return sections


# ---- flags -----------------------------------------------------------------------------


# the reference implementation's names ("optimizer" is also a section's name, so the field is optimizer_name)
FLAG_ALIASES = {"agent_path": ("--custom-agent-function-path",), "optimizer_name": ("--optimizer",)}


def _field_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return _field_type(args[0])
    if typing.get_origin(annotation) is Literal:
        return str
    return annotation


def _choices(annotation) -> tuple | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of settings (flags override it; a run's config.json reads back)")
    for cls in SECTIONS.values():
        field_flags(parser.add_argument_group(cls.TITLE), cls)


def field_flags(group, cls) -> None:
    """One flag per field of the pydantic model ``cls`` (``foo_bar`` is ``--foo-bar``; booleans are
    switches), every default None so that only what was given reaches the model."""
    for name, field in cls.model_fields.items():
        if not has_flag(field):
            continue
        flags = [flag(name), *FLAG_ALIASES.get(name, ())]
        kind = _field_type(field.annotation)
        if kind is bool:
            group.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=field.description
            )
        else:
            group.add_argument(
                *flags,
                dest=name,
                type=kind,
                default=None,
                choices=_choices(field.annotation),
                help=f"{field.description or ''} (default: {field.default})",
            )


def has_flag(field) -> bool:
    """False for a field set another way (``sglang_server_args``: the ``--sglang-*`` flags collected)."""
    return (field.json_schema_extra or {}).get("flag", True)


def config_from_args(args: argparse.Namespace, leave_out: frozenset[str] = frozenset()) -> RunConfig:
    """The run's config from ``--config`` and the flags given over it; ``leave_out``: settings a command that
    does not use them drops from both (the audit's training-only ones), leaving them at their defaults."""
    values: dict = {}
    if getattr(args, "config", None):
        import yaml

        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {args.config}: expected a mapping of settings")
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    for name in FIELD_SECTION:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    values = {name: value for name, value in values.items() if name not in leave_out}
    # a run's config.json holds the derived switch too: read back, it must agree with what it derives from
    derived = {k: values.pop(k) for k in list(values) if k == "use_sampling_support_replay"}
    cfg = RunConfig(**values)
    for name, value in derived.items():
        if getattr(cfg, name) != value:
            raise ConfigError(
                f"{flag(name)}={value!r}: is derived from the rollout sampling settings and cannot be set"
            )
    return cfg


def describe_validation(exc: ValidationError) -> str:
    """The first error of a pydantic validation, as ``--flag=value: why``."""
    err = exc.errors()[0]
    if "error" in err.get("ctx", {}):  # a rule of ours: its message already names the flag and the value
        return str(err["ctx"]["error"])
    name = str(err["loc"][-1]) if err.get("loc") else "config"
    return f"{flag(name)}={err.get('input')!r}: {err['msg']}"


def flag_table() -> str:
    """The markdown table of every flag, its default and its meaning, by section (docs/training.md)."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for cls in SECTIONS.values():
        lines.append(f"| **{cls.TITLE}** | | |")
        for name, field in cls.model_fields.items():
            if not has_flag(field):
                continue
            shown = flag(name)
            if _field_type(field.annotation) is bool:
                shown = f"{shown} / --no-{name.replace('_', '-')}"
            meaning = (field.description or "").replace("|", "/")
            default = field.default if field.default_factory is None else field.default_factory()
            lines.append(f"| `{shown}` | `{default}` | {meaning} |")
    lines.append("<!-- by: make flag-table -->")  # the command that writes it (tests/test_figure_tags.py)
    return "\n".join(lines) + "\n"
