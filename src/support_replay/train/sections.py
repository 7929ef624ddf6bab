"""The sections of a run's config: small frozen models, each with its fields (flag, default,
meaning) and the rules that need nothing outside it, validated where it is defined.

Each field ``foo_bar`` is the flag ``--foo-bar`` (slime / Miles names). Rules that join two
sections live in ``RunConfig`` (train/config.py). A rejection names the flag and the value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, computed_field, model_validator

from ..backends.registry import DEFAULT_REMOTE, kind_class, kind_name, remote_names
from ..core.penalties import Penalties
from ..core.sampling import SamplingParams
from ..errors import ConfigError, SamplingParamsError
from ..modeling.decode_attention import HELP as DECODE_ATTENTION_HELP
from ..modeling.linear_kernels import LINEAR_KERNEL_HELP
from ..protocol import DEFAULT_SAMPLING_MASK_MAX_TOKENS
from .distillation_config import DistillationConfig
from .launch_config import LaunchConfig
from .section_base import Section, bad

DEFAULT_MAX_OPERAND = 10  # the built-in arithmetic task's
MAX_DEFAULT_MICRO_BATCH = 8
FP32_CI_TOLERANCE = 1e-3  # docs/training.md, "--ci-test": 40x the largest fp32 difference measured
BF16_CI_TOLERANCE = 1.0  # docs/training.md: bf16 logits carry 8 bits of mantissa; up to 0.34 measured on SmolLM2
NEUTRAL_PENALTIES = {
    "rollout_frequency_penalty": 0.0,
    "rollout_presence_penalty": 0.0,
    "rollout_repetition_penalty": 1.0,
}


class DataConfig(Section):
    """Model, data and reward."""

    TITLE: ClassVar[str] = "model, data and reward"

    hf_checkpoint: str | None = Field(
        None, description="Hugging Face checkpoint directory; default: SmolLM2-135M-Instruct from the packaged GGUF"
    )
    prompt_data: str | None = Field(
        None,
        description="JSONL or Parquet prompts, or reasoning_gym:NAME (a reasoning-gym task, generated offline); "
        "default: the built-in arithmetic task",
    )
    task_max_operand: int | None = Field(
        None,
        ge=1,
        description=f"the built-in arithmetic task's largest operand (its difficulty; default {DEFAULT_MAX_OPERAND}); "
        "refused with --prompt-data",
    )
    input_key: str = Field("prompt", description="field holding the prompt (a string, or a list of chat messages)")
    label_key: str = Field("label", description="field holding the reference answer")
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's chat template")
    rm_type: Literal["math", "math-verify", "reasoning_gym"] | None = Field(
        "math",
        description="built-in reward: math = the final number or \\boxed{} equals the label; math-verify = Hugging "
        "Face's math-verify (LaTeX, fractions, \\boxed{}, units); reasoning_gym = the --prompt-data "
        "reasoning_gym:NAME task's own scorer",
    )
    custom_rm_path: str | None = Field(
        None, description="custom reward 'module:function(prompt, response, label) -> float'"
    )

    @property
    def max_operand(self) -> int:
        return self.task_max_operand or DEFAULT_MAX_OPERAND

    @model_validator(mode="after")
    def _check(self):
        if self.task_max_operand is not None and self.prompt_data:
            bad(
                "task_max_operand",
                self.task_max_operand,
                f"sets the built-in task; --prompt-data={self.prompt_data!r} brings its own prompts",
            )
        if self.custom_rm_path and ":" not in self.custom_rm_path:
            bad("custom_rm_path", self.custom_rm_path, "expected 'module:function'")
        if self.rm_type is None and not self.custom_rm_path:
            bad("rm_type", None, "give a reward: --rm-type math or --custom-rm-path module:function")
        task = (self.prompt_data or "").startswith("reasoning_gym:")
        if self.rm_type == "reasoning_gym" and not task and not self.custom_rm_path:
            bad("rm_type", "reasoning_gym", "scores reasoning-gym prompts: give --prompt-data reasoning_gym:NAME")
        if task and self.rm_type != "reasoning_gym" and not self.custom_rm_path:
            bad(
                "prompt_data",
                self.prompt_data,
                f"reasoning-gym answers are scored by the task's own scorer: give --rm-type reasoning_gym (not "
                f"{self.rm_type})",
            )
        return self


class RolloutConfig(Section):
    """Rollout sizes and sampling."""

    TITLE: ClassVar[str] = "rollout sizes and sampling"

    num_rollout: int = Field(20, ge=1, description="number of rollout + update steps")
    rollout_batch_size: int = Field(8, ge=1, description="prompts per rollout")
    n_samples_per_prompt: int = Field(4, ge=1, description="responses per prompt (the GRPO group)")
    rollout_max_response_len: int = Field(32, ge=1, description="max new tokens per response")
    rollout_ignore_eos: bool = Field(
        False,
        description="every response runs to --rollout-max-response-len tokens, past end-of-sequence (the engines' "
        "ignore_eos): fixed-length benchmarks",
    )
    rollout_temperature: float = Field(1.0, description="sampling temperature; the trainer divides actor logits by it")
    rollout_top_p: float = Field(0.8, description="top-p of rollout sampling, in (0, 1]")
    rollout_top_k: int = Field(32, description="top-k of rollout sampling, -1 or >= 1")
    rollout_min_p: float = Field(0.0, description="min-p of rollout sampling")
    rollout_frequency_penalty: float = Field(
        0.0, description="frequency penalty of rollout sampling, replayed by the trainer (needs replay)"
    )
    rollout_presence_penalty: float = Field(
        0.0, description="presence penalty of rollout sampling, replayed by the trainer (needs replay)"
    )
    rollout_repetition_penalty: float = Field(
        1.0, description="repetition penalty of rollout sampling, replayed by the trainer (needs replay)"
    )
    rollout_logit_bias: str | None = Field(
        None,
        description="JSON file {token id: bias} added to the rollout logits, replayed by the trainer (needs replay)",
    )
    rollout_seed: int = Field(42, description="seeds every rollout request (by rollout and sample index)")
    sampling_semantics: Literal["sglang", "vllm", "hf"] = Field(
        "sglang", description="filter semantics of the embedded engine"
    )
    sampling_mask_max_tokens: int = Field(
        DEFAULT_SAMPLING_MASK_MAX_TOKENS, ge=1, description="largest support the engine may capture"
    )

    _params: SamplingParams | None = PrivateAttr(None)
    _penalties: Penalties | None = PrivateAttr(None)

    @computed_field(description="derived: rollout top_p < 1, top_k > 0 or min_p > 0")
    @property
    def use_sampling_support_replay(self) -> bool:
        return self.sampling_params.replay_active

    @property
    def sampling_params(self) -> SamplingParams:
        """The rollout's sampling settings (no seed: each request gets its own), built once; their
        range rules are ``SamplingParams``'s."""
        return self._params

    @property
    def penalties(self) -> Penalties:
        return self._penalties

    @model_validator(mode="after")
    def _check(self):
        if self.rollout_temperature <= 0:
            bad(
                "rollout_temperature",
                self.rollout_temperature,
                "must be > 0 (the trainer divides the actor logits by it)",
            )
        try:
            params = SamplingParams(
                self.rollout_temperature, self.rollout_top_k, self.rollout_top_p, self.rollout_min_p
            )
        except SamplingParamsError as exc:  # "top_p: must be in (0, 1], got 0.0": the flag is rollout_<field>
            field, why = str(exc).split(": ", 1)
            name = f"rollout_{field}"
            bad(name, getattr(self, name), why.rsplit(", got ", 1)[0])
        self._params = params
        replay = params.replay_active
        if replay and self.rollout_top_k <= 0:
            knob = "rollout_top_p" if self.rollout_top_p < 1 else "rollout_min_p"
            bad(
                knob,
                getattr(self, knob),
                "a finite top-p or min-p needs a positive --rollout-top-k (the support would be unbounded)",
            )
        if replay and self.rollout_top_k > self.sampling_mask_max_tokens:
            bad(
                "rollout_top_k",
                self.rollout_top_k,
                f"exceeds --sampling-mask-max-tokens={self.sampling_mask_max_tokens}",
            )
        try:
            penalties = self._read_penalties()
        except (SamplingParamsError, OSError, ValueError) as exc:
            knob = "rollout_logit_bias" if self.rollout_logit_bias else "rollout_repetition_penalty"
            bad(knob, getattr(self, knob), str(exc))
        self._penalties = penalties
        if penalties.active and not replay:
            knob = next((n for n, v in NEUTRAL_PENALTIES.items() if getattr(self, n) != v), "rollout_logit_bias")
            bad(
                knob,
                getattr(self, knob),
                "penalties and logit bias are replayed on the captured support only: turn replay on "
                "(rollout top_p < 1, top_k > 0 or min_p > 0)",
            )
        if penalties.active and self.sampling_semantics == "hf" and (penalties.frequency or penalties.presence):
            knob = "rollout_frequency_penalty" if penalties.frequency else "rollout_presence_penalty"
            bad(
                knob,
                getattr(self, knob),
                "the hf semantics have no frequency or presence penalty (transformers has no such processor)",
            )
        return self

    def _read_penalties(self) -> Penalties:
        """The rollout's penalties and logit bias (``rollout_logit_bias`` read from its file, once)."""
        bias = json.loads(Path(self.rollout_logit_bias).read_text()) if self.rollout_logit_bias else None
        if bias is not None and not isinstance(bias, dict):
            raise ValueError("expected a JSON object {token id: bias}")
        return Penalties.with_bias(
            self.rollout_frequency_penalty, self.rollout_presence_penalty, self.rollout_repetition_penalty, bias
        )


class EngineConfig(Section):
    """The rollout engine: where it runs, how weights reach it, the wire form."""

    TITLE: ClassVar[str] = "the rollout engine: where it runs, how weights reach it, the wire form"

    rollout_url: str | None = Field(
        None, description="rollout through this engine/router URL instead of the in-process engine"
    )
    rollout_engine: str = Field(
        DEFAULT_REMOTE,
        description="protocol spoken at --rollout-url: sglang (SGLang, our serve and router, smg), vllm, or another "
        "registered engine kind (backends/registry.py)",
    )
    vllm_endpoint: Literal["generate", "completions"] = Field(
        "generate",
        description="vLLM endpoint: /inference/v1/generate (needs --enable-scale-out; reports weight versions) or "
        "/v1/completions",
    )
    vllm_capture: Literal["processed_logprobs", "native"] = Field(
        "processed_logprobs",
        description="how vLLM reveals the support: processed log-probs (--logprobs-mode processed_logprobs) or its "
        "native sampling_mask (--return-sampling-mask)",
    )
    colocate: bool = Field(
        False,
        description="rollout engine in the trainer's process, weights synced in memory (the default without "
        "--rollout-url)",
    )
    max_running_requests: int | None = Field(
        None,
        ge=1,
        description="sequences the in-process engine decodes together (SGLang's flag; default 64); the rest wait",
    )
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="KV positions the in-process engine may hold at its peak (SGLang's flag; default: a quarter of "
        "the memory available at start, leaving the rest to the trainer)",
    )
    weight_sync_mode: Literal["wait", "abort", "retract", "in_place"] = Field(
        "wait",
        description="requests running when weights are pushed: finish them on the old weights (wait), abort them "
        "(their groups are regenerated or dropped by --failed-group-policy), or go on under the new weights, "
        "SGLang's pause modes: retract (their keys and values recomputed under the new weights) or in_place (the "
        "old keys and values kept: a mismatch --ci-test names); each token keeps the version that sampled it",
    )
    weight_transport: Literal["disk", "http"] = Field(
        "disk",
        description="how weights reach a --rollout-url engine: a safetensors directory it can read (shared "
        "filesystem), or the body of POST /update_weights_from_safetensors (our serve and router, no "
        "shared filesystem)",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="with --lora-rank, what reaches a --rollout-url engine: the merged weights, or the adapter "
        "alone (SGLang's /load_lora_adapter, our serve merging it as the trainer does; vLLM's /v1/load_lora_adapter, "
        "in place)",
    )
    rollout_concurrency: int = Field(
        64, ge=1, description="requests the rollout client keeps in flight at --rollout-url (the engines batch them)"
    )
    sampling_mask_format: Literal["binary", "lists"] = Field(
        "binary",
        description="how --rollout-url engines send the support: our compact binary form (SGLang ignores the ask and "
        "sends lists), or id lists",
    )

    @model_validator(mode="after")
    def _check(self):
        if self.max_total_tokens is not None and self.rollout_url:
            bad(
                "max_total_tokens",
                self.max_total_tokens,
                "bounds the in-process engine; give it to the engine at --rollout-url (serve --max-total-tokens)",
            )
        if self.max_running_requests is not None and self.rollout_url:
            bad(
                "max_running_requests",
                self.max_running_requests,
                "bounds the in-process engine; give it to the engine at --rollout-url (serve --max-running-requests)",
            )
        if self.rollout_engine not in remote_names():
            bad("rollout_engine", self.rollout_engine, f"one of {remote_names()}")
        if self.weight_transport == "http" and not kind_class(kind_name(self)).weights_over_http:
            why = (
                "sends the weights to support-replay serve or router at --rollout-url; "
                f"{self.rollout_engine} loads from a directory"
                if self.rollout_url
                else "needs --rollout-url (the in-process engine takes the tensors in memory)"
            )
            bad("weight_transport", "http", why)
        if self.rollout_engine != DEFAULT_REMOTE and not self.rollout_url:
            bad(
                "rollout_engine",
                self.rollout_engine,
                "needs --rollout-url of a running server (the in-process engine speaks for itself)",
            )
        if self.colocate and self.rollout_url:
            bad("colocate", True, f"the in-process engine and --rollout-url={self.rollout_url!r} exclude each other")
        return self


class ProductionConfig(Section):
    """Rollouts across updates: policy lag, stale and failed groups."""

    TITLE: ClassVar[str] = "rollouts across updates: policy lag, stale and failed groups"

    async_rollout: bool = Field(
        False,
        description="generate the next rollout while the trainer updates on this one (needs --max-policy-lag >= 1)",
    )
    max_policy_lag: int = Field(
        0,
        ge=0,
        description="how many weight pushes old a sampled token may be; 0: every token from the weights just pushed",
    )
    partial_rollout: bool = Field(
        False,
        description="slime's: a rollout sends --over-sampling-batch-size groups, trains the first --rollout-batch-size "
        "to finish, stops the rest and keeps their tokens, continued in a later rollout (none generated again); "
        "a kept group whose tokens are --max-policy-lag pushes old is not stopped again (needs --max-policy-lag "
        ">= 1); tokens older than the lag (past twice the batch's over-sampling) are masked, not trained",
    )
    over_sampling_batch_size: int | None = Field(
        None,
        ge=1,
        description="groups a rollout sends with --partial-rollout (slime's; default: --rollout-batch-size, which "
        "stops nothing): more than --rollout-batch-size lets the slowest groups finish in a later rollout",
    )
    max_kept_capture_ids: int = Field(
        1 << 26,
        ge=1,
        description="--partial-rollout: support ids the kept groups may hold (the trainer's capture budget, as an "
        "engine's --max-capture-ids): past it a rollout sends no fresh groups beyond --rollout-batch-size until "
        "the kept ones drain (nothing kept is dropped)",
    )
    stale_sample_policy: Literal["fail", "drop", "regenerate"] = Field(
        "fail",
        description="a group with a token older than --max-policy-lag: stop the run, drop the group, or generate it "
        "again on the current weights",
    )
    failed_group_policy: Literal["regenerate", "drop"] = Field(
        "regenerate",
        description="a GRPO group with a response the engine never gave (down, overloaded, aborted): generate it "
        "again, or drop it",
    )
    max_regenerations: int = Field(
        2, ge=0, description="how many times a failed group is generated again before the run stops"
    )

    @model_validator(mode="after")
    def _check(self):
        if self.async_rollout and self.max_policy_lag < 1:
            bad(
                "async_rollout",
                True,
                "samples the next rollout on the weights before this update: needs --max-policy-lag >= 1",
            )
        if self.partial_rollout and self.max_policy_lag < 1:
            bad(
                "partial_rollout",
                True,
                "trains kept tokens at least one push after they were sampled: needs --max-policy-lag >= 1",
            )
        if self.partial_rollout and self.async_rollout:
            bad(
                "partial_rollout",
                True,
                "with --async-rollout: this project runs partial rollouts on synchronous rollouts only (the kept "
                "groups and a rollout generated beside the update are not combined yet)",
            )
        if self.over_sampling_batch_size is not None and not self.partial_rollout:
            bad("over_sampling_batch_size", self.over_sampling_batch_size, "is read with --partial-rollout only")
        if self.max_kept_capture_ids != 1 << 26 and not self.partial_rollout:
            bad("max_kept_capture_ids", self.max_kept_capture_ids, "is read with --partial-rollout only")
        return self


class AgentConfig(Section):
    """Agents (multi-turn, tools)."""

    TITLE: ClassVar[str] = "agents (multi-turn, tools)"

    agent: Literal["calculator", "chain"] | None = Field(
        None,
        description="built-in agent environment: calculator (arithmetic with a calculator tool) or chain (a "
        "multi-turn arithmetic dialogue); each brings its own tasks",
    )
    agent_path: str | None = Field(
        None,
        description="your agent: 'module:function', async run(client, sample) -> reward, or Miles' "
        "run_agent(base_url, prompt, request_kwargs=None, ...) (alias --custom-agent-function-path)",
    )
    max_turns: int = Field(
        8, ge=1, description="model turns per episode; later turns get an empty answer with finish_reason length"
    )
    max_episode_tokens: int = Field(
        512,
        ge=1,
        description="response tokens per episode (model and inserted); a turn that would pass it ends the episode",
    )
    session_history_policy: Literal["split", "reject"] = Field(
        "split",
        description="when an agent's messages stop extending the recorded trajectory: start a new sample there, or "
        "refuse the turn",
    )
    chat_template: str | None = Field(
        None,
        description="chat template for sessions: a Jinja file or a built-in name (hermes_tools); default: the "
        "tokenizer's (calculator: hermes_tools)",
    )
    agent_timeout: float = Field(600.0, gt=0, description="seconds one episode may take before it counts as failed")

    @property
    def enabled(self) -> bool:
        return bool(self.agent or self.agent_path)

    @model_validator(mode="after")
    def _check(self):
        if self.agent and self.agent_path:
            bad("agent_path", self.agent_path, f"and --agent={self.agent} exclude each other: one agent per run")
        if self.agent_path and not (":" in self.agent_path or "." in self.agent_path):
            bad("agent_path", self.agent_path, "expected 'module:function' (or Miles' 'module.function')")
        return self


class ParallelConfig(Section):
    """Batches and parallelism."""

    TITLE: ClassVar[str] = "batches and parallelism"

    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="samples per optimizer step (default: rollout_batch_size x n_samples_per_prompt / "
        "--num-steps-per-rollout, as Miles and slime derive it)",
    )
    num_steps_per_rollout: int | None = Field(
        None,
        ge=1,
        description="optimizer steps per rollout (Miles' and slime's flag; default 1, or what --global-batch-size "
        "gives); sets --global-batch-size",
    )
    train_backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="fsdp: the trainer is FSDP2 over torchrun ranks, with DTensor TP and CP (Miles' name)"
    )
    actor_num_nodes: int | None = Field(
        None,
        ge=1,
        description="Miles' layout: nodes of trainer ranks; with --actor-num-gpus-per-node, checked "
        "against the torchrun world the run starts in",
    )
    actor_num_gpus_per_node: int | None = Field(
        None, ge=1, description="Miles' layout: trainer ranks per node (processes on a CPU)"
    )
    tensor_model_parallel_size: int = Field(
        1,
        ge=1,
        description="trainer ranks that split each layer's heads, MLP and vocabulary (DTensor; the LM head scored "
        "vocab-parallel)",
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="trainer ranks that split each sequence by position (attention all-gathers keys and values)",
    )
    context_parallel_layout: Literal["zigzag", "contiguous"] = Field(
        "zigzag",
        description="how --context-parallel-size splits a sequence: zigzag (2 chunks per rank, balanced causal work) "
        "or contiguous",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="padded tokens (samples x longest prompt + response) per forward/backward on one rank: short "
        "samples batch many, long ones few",
    )
    packed_scoring: Literal["auto", "on", "off"] = Field(
        "auto",
        description="score a prompt's samples as one packed row, the prompt once and each response attending to it "
        "and to itself (same math, fewer tokens); auto: on unless penalties or context parallelism need "
        "rows of their own",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="the older way: samples per forward/backward on one rank (default without a token budget: the "
        f"largest divisor of --global-batch-size up to {MAX_DEFAULT_MICRO_BATCH})",
    )

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward: the flag, or the largest divisor of the global batch up to 8."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return max(d for d in range(1, MAX_DEFAULT_MICRO_BATCH + 1) if self.global_batch_size % d == 0)

    @property
    def split(self) -> str | None:
        """The flag that splits one sequence's work over ranks (tensor or context parallelism), or None."""
        if self.tensor_model_parallel_size > 1:
            return "tensor_model_parallel_size"
        return "context_parallel_size" if self.context_parallel_size > 1 else None

    @model_validator(mode="after")
    def _check(self):
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            bad(
                "micro_batch_size",
                self.micro_batch_size,
                f"counts samples, --max-tokens-per-micro-batch={self.max_tokens_per_micro_batch} tokens: give one of "
                "them",
            )
        if self.micro_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            bad("micro_batch_size", self.micro_batch_size, f"must divide --global-batch-size={self.global_batch_size}")
        if self.train_backend == "megatron":
            bad("train_backend", "megatron", "the trainer is FSDP2 (with DTensor TP and CP): use --train-backend fsdp")
        if (self.actor_num_nodes is None) != (self.actor_num_gpus_per_node is None):
            given = "actor_num_nodes" if self.actor_num_nodes is not None else "actor_num_gpus_per_node"
            bad(given, getattr(self, given), "give --actor-num-nodes and --actor-num-gpus-per-node together")
        return self

    @property
    def actor_ranks(self) -> int | None:
        """The trainer ranks Miles' layout flags name (None: not given)."""
        if self.actor_num_nodes is None:
            return None
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def check_world(self, world: int) -> None:
        """The layout flags against the torchrun world the run started in."""
        if self.actor_ranks is not None and self.actor_ranks != world:
            raise ConfigError(
                f"--actor-num-gpus-per-node={self.actor_num_gpus_per_node} with --actor-num-nodes="
                f"{self.actor_num_nodes}: {self.actor_ranks} trainer ranks, but this run has {world}; start it with "
                f"`torchrun --nnodes {self.actor_num_nodes} --nproc-per-node "
                f"{self.actor_num_gpus_per_node} -m support_replay.cli train ...` or `support-replay local-run "
                f"--nproc-per-node {self.actor_ranks} -- ...`, or drop both flags"
            )


class OptimizerConfig(Section):
    """Optimizer and loss."""

    TITLE: ClassVar[str] = "optimizer and loss"

    lr: float = Field(
        2e-5,
        gt=0,
        description="learning rate (AdamW); the default suits the built-in demo (a 135M model, 20 updates), large "
        "models train at about 1e-6",
    )
    optimizer_name: Literal["adam"] = Field(
        "adam",
        description="also --optimizer: adam is AdamW, decoupled weight decay (Megatron's, slime's and Miles' adam)",
    )
    lr_warmup_iters: int = Field(0, ge=0, description="optimizer steps of linear warmup to --lr")
    lr_warmup_fraction: float | None = Field(
        None, ge=0, le=1, description="the warmup as a fraction of the run's optimizer steps (instead of iters)"
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warmup: keep --lr, or decay it linearly or by a cosine to --min-lr"
    )
    lr_decay_iters: int | None = Field(
        None, ge=1, description="the optimizer step at which the decay reaches --min-lr (default: the run's last)"
    )
    min_lr: float = Field(0.0, ge=0, description="the learning rate the decay ends at")
    lora_rank: int = Field(
        0, ge=0, description="train LoRA adapters of this rank over frozen base weights (0: every weight)"
    )
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: the update is alpha / rank x B A")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch's input")
    lora_target_modules: str = Field(
        "all-linear", description="the modules that get adapters: all-linear (every linear but the LM head) or names"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.98, description="AdamW beta2")
    clip_grad: float = Field(1.0, description="max global gradient norm (0: off)")
    advantage_estimator: Literal["grpo"] = Field(
        "grpo", description="group-relative advantages: reward minus the group mean (over its std)"
    )
    disable_grpo_std_normalization: bool = Field(False, description="GRPO advantages without dividing by the group std")
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range (low side)")
    eps_clip_high: float | None = Field(None, description="PPO clip range, high side (default: eps_clip)")
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="mean over all trained tokens, or per sequence then over sequences"
    )
    kl_coef: float = Field(0.0, ge=0, description="KL(actor || reference) penalty subtracted from the reward")
    use_kl_loss: bool = Field(False, description="add KL(actor || reference) to the loss")
    kl_loss_coef: float = Field(0.0, ge=0, description="weight of the KL loss")
    kl_loss_type: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator of the KL loss")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus (full-vocabulary entropy)")
    use_rollout_logprobs: bool = Field(
        False, description="old log-probs from the rollout log mu instead of recomputing them"
    )
    use_tis: bool = Field(False, description="truncated importance sampling against the rollout log mu")
    tis_cap: float = Field(2.0, gt=0, description="truncation of the importance weight pi_old / mu")
    tis_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="--use-tis weights: min(pi_old / mu, cap) (TIS), or 1 inside [1/cap, cap] and 0 outside (masked "
        "IS)",
    )
    policy_loss: Literal["ppo", "reinforce"] = Field(
        "ppo",
        description="ppo: the clipped surrogate on pi / pi_old; reinforce: -A sg(w) log pi, the importance-weighted "
        "policy gradient against the sampler, no clipping, w from --score-centering-weight",
    )
    use_score_centering: bool = Field(
        False,
        description="subtract the sampler-expected score on the replayed support (score centering, docs/math.md): "
        "adds A * sum_v sg(q_v w_v) log pi(v) per model token; needs --policy-loss reinforce",
    )
    score_centering_weight: Literal["none", "ratio", "tis", "mis"] = Field(
        "none",
        description="w = f(pi / q) of the reinforce loss and of score centering: none 1, ratio pi/q, tis "
        "min(pi/q, --tis-cap), mis 1 inside [1/--tis-cap, --tis-cap] and 0 outside (with ratio the centring "
        "term's gradient is 0 on the support: E_pi[s] = 0)",
    )
    seed: int = Field(1234, description="trainer seed (initialisation, shuffling)")

    @property
    def weight_uses_cap(self) -> bool:
        """Whether --tis-cap is read by the reinforce / score-centering weight."""
        return self.policy_loss == "reinforce" and self.score_centering_weight in ("tis", "mis")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.use_kl_loss

    @model_validator(mode="after")
    def _check(self):
        self._check_schedule()
        defaults = type(self).model_fields
        for name in ("lora_alpha", "lora_dropout", "lora_target_modules"):
            if not self.lora_rank and getattr(self, name) != defaults[name].default:
                bad(name, getattr(self, name), "has no effect without --lora-rank")
        if self.use_kl_loss and self.kl_loss_coef <= 0:
            bad("kl_loss_coef", self.kl_loss_coef, "must be > 0 with --use-kl-loss")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            bad("kl_loss_coef", self.kl_loss_coef, "has no effect without --use-kl-loss")
        if self.tis_mode == "mask" and self.tis_cap <= 1:
            bad("tis_cap", self.tis_cap, "masked IS keeps ratios inside [1/cap, cap]: needs a cap > 1")
        if self.tis_mode != "truncate" and not self.use_tis:
            bad("tis_mode", self.tis_mode, "has no effect without --use-tis")
        if self.use_score_centering and self.policy_loss == "ppo":
            bad(
                "use_score_centering",
                True,
                "needs --policy-loss reinforce: the centring subtracts sum_v q_v w_v s_v, which equals the sampler-"
                "expected part of the gradient only when every id's weight is a function of that id; PPO's clip "
                "indicator depends on the sign of the advantage of the one sampled continuation, so a counterfactual "
                "id's weight is undefined and the term is not known to be correct beside clipping",
            )
        if self.policy_loss == "reinforce" and self.use_tis:
            bad("use_tis", True, "the reinforce loss is weighted by --score-centering-weight (tis, mis), not --use-tis")
        if self.policy_loss == "reinforce" and self.use_rollout_logprobs:
            bad("use_rollout_logprobs", True, "has no effect with --policy-loss reinforce (it reads no old log-probs)")
        # against the default, not the fields set: a written config.json names every field
        if self.tis_cap != type(self).model_fields["tis_cap"].default and not (self.use_tis or self.weight_uses_cap):
            bad("tis_cap", self.tis_cap, "is read by --use-tis or by --score-centering-weight tis|mis only")
        if self.weight_uses_cap and self.score_centering_weight == "mis" and self.tis_cap <= 1:
            bad("tis_cap", self.tis_cap, "the mis weight keeps ratios inside [1/cap, cap]: needs a cap > 1")
        if self.use_tis and self.use_rollout_logprobs:
            bad(
                "use_tis",
                True,
                "with --use-rollout-logprobs the old policy is the rollout's own, so pi_old / mu is 1 "
                "and there is nothing to correct",
            )
        return self

    @property
    def lora(self):
        """The LoRA settings (modeling/lora.py), or None for full fine-tuning."""
        from ..modeling.lora import LoraSettings

        if not self.lora_rank:
            return None
        return LoraSettings(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_target_modules)

    def _check_schedule(self) -> None:
        defaults = type(self).model_fields
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            bad(
                "lr_warmup_fraction", self.lr_warmup_fraction, f"and --lr-warmup-iters={self.lr_warmup_iters}: give one"
            )
        if self.min_lr > self.lr:
            bad("min_lr", self.min_lr, f"is above --lr={self.lr}")
        if self.lr_decay_style == "constant":
            for name in ("lr_decay_iters", "min_lr"):
                if getattr(self, name) != defaults[name].default:
                    bad(name, getattr(self, name), "has no effect with --lr-decay-style constant")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            bad(
                "lr_decay_iters",
                self.lr_decay_iters,
                f"must be after the warmup (--lr-warmup-iters={self.lr_warmup_iters})",
            )


class ReplayConfig(Section):
    """Replay and checks: dtypes, kernels, --ci-test, drift."""

    TITLE: ClassVar[str] = "replay and checks: dtypes, kernels, --ci-test, drift"

    ci_test: bool = Field(
        False, description="fail unless the trainer's support log-probs match the rollout log mu on every token"
    )
    ci_test_tolerance: float | None = Field(
        None,
        ge=0,
        description=f"per-token max |log pi - log mu| allowed by --ci-test (default: {FP32_CI_TOLERANCE:g} in fp32, "
        f"{BF16_CI_TOLERANCE:g} when either side runs bf16; 0 in true-on-policy mode)",
    )
    full_vocab_metrics_interval: int = Field(
        1,
        ge=1,
        description="under replay, score the full vocabulary for the metrics (full_vocab_ratio_*) every N rollouts "
        "only; the KL reward still takes it every rollout",
    )
    min_support_mass: float = Field(
        0.0,
        ge=0,
        le=1,
        description="drop from the loss a stale sample (lag >= 1) whose mean current-policy mass inside its replayed "
        "supports is below this (0: off)",
    )
    rollout_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the in-process engine's weights and compute (a --rollout-url engine runs its own: say it here "
        "for the --ci-test tolerance)",
    )
    train_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the trainer's compute (autocast; weights, gradients and optimizer state stay fp32)"
    )
    use_rollout_routing_replay: bool = Field(
        False,
        description="mixture-of-experts models: the engine returns the experts it routed every position to, and "
        "the trainer's ratio forwards use them (Miles' R3; the combine weights are the current router's at those "
        "experts, so the router still learns)",
    )
    true_on_policy_mode: bool = Field(
        False,
        description="batch-invariant engine and trainer: rollout and trainer log-probs equal bit for bit (--ci-test "
        "then demands it)",
    )
    linear_kernel: Literal["auto", "torch", "onednn"] = Field("auto", description=LINEAR_KERNEL_HELP)
    decode_attention: Literal["auto", "kernel", "sdpa"] = Field("auto", description=DECODE_ATTENTION_HELP)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = Field(
        "sdpa",
        description="the trainer's attention, as transformers names it: sdpa or eager on this device (true-on-policy "
        "mode and context parallelism run their own)",
    )
    deterministic_mode: bool = Field(
        False,
        description="torch.use_deterministic_algorithms in the trainer: an op without a deterministic kernel fails "
        "instead of running (Miles' and slime's flag)",
    )

    @property
    def ci_tolerance(self) -> float:
        """What --ci-test allows per token: the flag, or what the dtypes of the two sides allow."""
        if self.true_on_policy_mode:
            return 0.0
        if self.ci_test_tolerance is not None:
            return self.ci_test_tolerance
        return BF16_CI_TOLERANCE if "bfloat16" in (self.rollout_dtype, self.train_dtype) else FP32_CI_TOLERANCE

    @model_validator(mode="after")
    def _check(self):
        if self.true_on_policy_mode and self.rollout_dtype != self.train_dtype:
            bad(
                "train_dtype",
                self.train_dtype,
                f"true-on-policy mode computes the same bits on both sides, so in one dtype: the rollout's is "
                f"{self.rollout_dtype} (--rollout-dtype)",
            )
        if self.attn_implementation.startswith("flash_attention"):
            bad(
                "attn_implementation",
                self.attn_implementation,
                "FlashAttention needs CUDA and the flash-attn kernels, which this trainer was not built and tested "
                "with: use sdpa (the default) or eager",
            )
        if self.attn_implementation == "flex_attention":
            bad(
                "attn_implementation",
                "flex_attention",
                "is not wired into the trainer's packed scoring: use sdpa or eager",
            )
        if self.attn_implementation != "sdpa" and self.true_on_policy_mode:
            bad(
                "attn_implementation",
                self.attn_implementation,
                "true-on-policy mode runs the engine's batch-invariant attention in the trainer too",
            )
        return self


class EvalConfig(Section):
    """Evaluation."""

    TITLE: ClassVar[str] = "evaluation"

    eval_interval: int | None = Field(None, ge=1, description="evaluate every N rollouts")
    eval_prompt_data: str | None = Field(None, description="evaluation prompts (default: held-out built-in task)")
    n_eval_prompts: int = Field(16, ge=1, description="prompts per evaluation")
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="responses per evaluation prompt")
    eval_temperature: float = Field(0.0, ge=0, description="evaluation sampling temperature (0: greedy)")
    eval_top_p: float = Field(1.0, description="evaluation top-p")
    eval_top_k: int = Field(-1, description="evaluation top-k")
    eval_max_response_len: int | None = Field(
        None, ge=1, description="evaluation max new tokens (default: the rollout one)"
    )

    def due(self, rollout: int) -> bool:
        """Whether an evaluation follows rollout ``rollout``."""
        return bool(self.eval_interval) and (rollout + 1) % self.eval_interval == 0

    @model_validator(mode="after")
    def _check(self):
        if self.eval_prompt_data and not self.eval_interval:
            bad("eval_prompt_data", self.eval_prompt_data, "has no effect without --eval-interval N")
        return self


class OutputConfig(Section):
    """Logging and output."""

    TITLE: ClassVar[str] = "logging and output"

    output_dir: str = Field("runs/latest", description="metrics, effective config, plot")
    save: str | None = Field(None, description="checkpoint directory")
    save_interval: int | None = Field(None, ge=1, description="checkpoint every N rollouts")
    resume: bool = Field(False, description="continue from the latest checkpoint in --save")
    progress: bool = Field(True, description="progress bar on the console")
    use_wandb: bool = Field(False, description="log every metric and the config to Weights & Biases (rank 0)")
    wandb_project: str = Field("support-replay", description="the W&B project")
    wandb_group: str | None = Field(None, description="the W&B run group")
    wandb_run_name: str | None = Field(None, description="the W&B run name (default: W&B's)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: $WANDB_MODE, else W&B's own: online); offline writes the run locally"
    )
    wandb_dir: str | None = Field(None, description="where W&B writes its files (default: --output-dir)")
    use_tensorboard: bool = Field(False, description="log every metric to TensorBoard event files (rank 0)")
    tensorboard_dir: str | None = Field(
        None, description="the event files' directory (default: OUTPUT_DIR/tensorboard)"
    )

    @model_validator(mode="after")
    def _check(self):
        defaults = type(self).model_fields
        for name in ("wandb_project", "wandb_group", "wandb_run_name", "wandb_mode", "wandb_dir"):
            if getattr(self, name) != defaults[name].default and not self.use_wandb:
                bad(name, getattr(self, name), "has no effect without --use-wandb")
        if self.tensorboard_dir is not None and not self.use_tensorboard:
            bad("tensorboard_dir", self.tensorboard_dir, "has no effect without --use-tensorboard")
        if self.resume and not self.save:
            bad("resume", True, "needs --save DIR to resume from")
        if self.save_interval and not self.save:
            bad("save_interval", self.save_interval, "needs --save DIR to write checkpoints to")
        return self


SECTIONS = {
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "launch": LaunchConfig,
    "production": ProductionConfig,
    "agents": AgentConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "distillation": DistillationConfig,
    "replay": ReplayConfig,
    "evaluation": EvalConfig,
    "output": OutputConfig,
}
