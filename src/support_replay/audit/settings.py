"""The audit's own settings: thresholds of the certificate, the expected weight version, what its
client sends. Everything else comes from the run's flags (``train``'s), read as ``train`` reads them.

Default thresholds follow the run's dtypes (docs/audit.md, "thresholds"): in fp32 the trainer and
the engine agree on the same support to about 1e-5 per token, so 1e-3 (``--ci-test``'s tolerance)
and a mismatch KL of 1e-4 leave a wide margin for numerics while the truncation bias of the
gentlest filter users run (top_p 0.98, a ratio of 0.98 per token: KL 2e-4) fails; with bf16 on
either side per-token differences reach a few tenths (0.34 measured on SmolLM2) and the KL a few
1e-3, so 1.0 and 1e-2, which a top_p 0.8 truncation (KL 0.023) still fails. True-on-policy mode
promises bitwise equality: 0 and 0.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from ..protocol import SAMPLING_FIELDS, settings_by_field

# train's flags that act only while training: the audit samples one rollout and scores it; it never steps an
# optimizer, pushes weights, evaluates, checkpoints or logs to a tracker. Left out of the audit's config, so a
# training rule on them (a batch that must divide, a decay that must end after its warmup) cannot stop an audit.
TRAINING_ONLY = frozenset(
    {
        "num_rollout",
        "weight_sync_mode",
        "weight_transport",
        "lora_sync",
        "async_rollout",
        "max_policy_lag",
        "stale_sample_policy",
        "global_batch_size",
        "num_steps_per_rollout",
        "lr",
        "optimizer_name",
        "lr_warmup_iters",
        "lr_warmup_fraction",
        "lr_decay_style",
        "lr_decay_iters",
        "min_lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "clip_grad",
        "advantage_estimator",
        "disable_grpo_std_normalization",
        "eps_clip",
        "eps_clip_high",
        "loss_aggregation",
        "kl_coef",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "entropy_coef",
        "use_rollout_logprobs",
        "use_tis",
        "tis_cap",
        "tis_mode",
        "policy_loss",
        "use_score_centering",
        "score_centering_weight",
        "ci_test",
        "full_vocab_metrics_interval",
        "min_support_mass",
        "eval_interval",
        "eval_prompt_data",
        "n_eval_prompts",
        "n_samples_per_eval_prompt",
        "eval_temperature",
        "eval_top_p",
        "eval_top_k",
        "eval_max_response_len",
        "save",
        "save_interval",
        "resume",
        "use_wandb",
        "wandb_project",
        "wandb_group",
        "wandb_run_name",
        "wandb_mode",
        "wandb_dir",
        "use_tensorboard",
        "tensorboard_dir",
    }
)
FP32_MAX_MISMATCH_KL = 1e-4
BF16_MAX_MISMATCH_KL = 1e-2
# what a client that sets nothing gets from SGLang, vLLM (without a generation_config.json) and OpenAI's API
NEUTRAL_SAMPLING = {
    "temperature": 1.0,
    "top_k": -1,
    "top_p": 1.0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
}


class AuditSettings(BaseModel):
    """``support-replay audit``'s flags beside the run's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_mismatch_kl: float | None = Field(
        None,
        ge=0,
        description="largest mean k3 KL(mu || pi) of the trainer's scoring that passes (default: "
        f"{FP32_MAX_MISMATCH_KL:g} in fp32, {BF16_MAX_MISMATCH_KL:g} when either side runs bf16, 0 in true-on-policy "
        "mode)",
    )
    max_abs_logprob_diff: float | None = Field(
        None,
        ge=0,
        description="largest per-token |log pi - log mu| of the trainer's scoring that passes (default: --ci-test's "
        "tolerance, 1e-3 in fp32, 1.0 with bf16, 0 in true-on-policy mode)",
    )
    expected_weight_version: str | None = Field(
        None, description="the weight version every answer must report (a checkpoint has no version of its own)"
    )
    send_neutral_sampling_settings: bool = Field(
        False,
        description="send every sampling setting, neutral ones too, as the trainer does to neutralise an engine's "
        "defaults (default: send only what differs from the API's neutral value, as a user's client does)",
    )
    vllm_max_logprobs: int = Field(
        -1,
        description="processed log-probs asked per token when the run declares no top_k (-1: every id; the vLLM "
        "server needs --max-logprobs -1)",
    )

    @classmethod
    def from_flags(cls, **values) -> AuditSettings:
        """The settings from flag values; a bad one is a ``ConfigError`` naming the flag and the value."""
        from ..train.config import describe_validation

        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(describe_validation(exc)) from None

    def thresholds(self, replay) -> tuple[float, float]:
        """``(max mismatch KL, max |log pi - log mu|)``: the flags, or the defaults of the run's dtypes."""
        bf16 = "bfloat16" in (replay.rollout_dtype, replay.train_dtype)
        kl = 0.0 if replay.true_on_policy_mode else (BF16_MAX_MISMATCH_KL if bf16 else FP32_MAX_MISMATCH_KL)
        return (
            self.max_mismatch_kl if self.max_mismatch_kl is not None else kl,
            self.max_abs_logprob_diff if self.max_abs_logprob_diff is not None else replay.ci_tolerance,
        )


def audit_config(args):
    """``(the run's config as the audit reads it, the training-only flags it left out)``: ``train``'s flags and
    ``--config`` file, less ``TRAINING_ONLY``, so a launch command with ``train`` swapped for ``audit`` runs."""
    from ..train.config import config_from_args, flag

    left_out = sorted(flag(name) for name in TRAINING_ONLY if getattr(args, name, None) is not None)
    return config_from_args(args, leave_out=TRAINING_ONLY), left_out


def declared_sampling(rollout) -> dict:
    """The run's sampling settings under the request field names."""
    return settings_by_field(rollout.sampling_params, rollout.penalties)


def sent_fields(declared: dict, send_neutral: bool) -> frozenset[str]:
    """The settings the audit's client sends: all, or those that differ from the neutral value."""
    if send_neutral:
        return frozenset(SAMPLING_FIELDS)
    return frozenset(k for k in SAMPLING_FIELDS if declared[k] != NEUTRAL_SAMPLING[k])
