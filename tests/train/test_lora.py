"""LoRA RL: adapters train over frozen base weights, the engine samples the merged weights, --ci-test holds,
checkpoints hold the adapter in peft's layout and a resume continues from it."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from recipe_helpers import run_config
from support_replay.errors import ConfigError
from support_replay.train import train
from support_replay.train.config import RunConfig

pytest.importorskip("peft")
LORA = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2, num_rollout=3)


def test_lora_trains_adapters_the_engine_samples_merged_and_a_checkpoint_holds_the_adapter(tiny_checkpoint, tmp_path):
    from peft import PeftModel

    save = dict(save=str(tmp_path / "ckpt"), save_interval=3)
    rows = train(run_config(tiny_checkpoint, tmp_path, **LORA, **save))
    # the engine ran the merged weights after each update, the trainer W x + B A x: --ci-test within 1e-3
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)
    ckpt = tmp_path / "ckpt" / "rollout_000003"
    base = load_file(str(tiny_checkpoint / "model.safetensors"))
    merged = load_file(str(ckpt / "model.safetensors"))
    assert set(merged) == set(base)  # the base model's names: a Hugging Face checkpoint as it stands
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # only adapted linears moved
    assert torch.equal(base["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])
    # peft reads the adapter; base + adapter and the merged checkpoint compute the same logits
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), str(ckpt)).eval()
        merged_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
        merged_model.load_state_dict(merged, strict=False)  # the tied head is the embedding
        torch.testing.assert_close(peft_model(ids).logits, merged_model(ids).logits, atol=1e-5, rtol=0)
    # a resume continues from the adapter
    resumed = train(run_config(tiny_checkpoint, tmp_path, **{**LORA, "num_rollout": 4}, resume=True, **save))
    assert resumed[-1]["rollout"] == 3 and resumed[-1]["train_rollout_logprob_abs_diff_max"] <= 1e-3
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):
        train(run_config(tiny_checkpoint, tmp_path, lr=1e-2, num_rollout=4, resume=True, **save))


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(lora_rank=4, tensor_model_parallel_size=2, global_batch_size=32), "--tensor-model-parallel-size=2: LoRA"),
        (dict(lora_rank=4, true_on_policy_mode=True), "--lora-rank=4: true-on-policy mode"),
        (dict(lora_alpha=32.0), "--lora-alpha=32.0: has no effect without --lora-rank"),
    ],
)
def test_lora_settings_that_cannot_hold_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)


def test_lora_without_peft_is_refused_by_name(tiny_checkpoint, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ConfigError, match="--lora-rank: the peft package is not installed"):
        train(run_config(tiny_checkpoint, tmp_path, lora_rank=4, num_rollout=1))


@pytest.mark.slow
@pytest.mark.processes
def test_the_adapter_alone_reaches_a_served_engine_and_samples_as_the_merged_weights(tiny_checkpoint, tmp_path):
    """--lora-sync adapter through a serve engine the run starts: the engine merges the adapter as the trainer does,
    so every rollout is the merged-weights run's, bit for bit, for a fraction of the bytes per push (the engine's
    batch-invariant forward makes a rollout independent of how its requests were batched)."""
    from support_replay.started_engines import started_engines

    runs = {}
    launch = dict(rollout_num_gpus_per_engine=1, sglang_server_args=("--sglang-enable-deterministic-inference",))
    for sync in ("merged", "adapter"):
        cfg = run_config(tiny_checkpoint, tmp_path / sync, **LORA, **launch, lora_sync=sync, progress=False)
        with started_engines(cfg) as running:
            runs[sync] = train(running, as_given=cfg)
    same = ("reward_mean", "response_len_mean", "train_rollout_logprob_abs_diff_max", "loss", "grad_norm")
    for merged_row, adapter_row in zip(runs["merged"], runs["adapter"]):
        assert {k: merged_row[k] for k in same} == {k: adapter_row[k] for k in same}
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in runs["adapter"])
    weights = tmp_path / "adapter" / "out" / "weights"
    assert [p.name for p in weights.iterdir()] == ["adapter-3"]  # the last one; the engine read each in turn
    adapter_bytes = (weights / "adapter-3" / "adapter_model.safetensors").stat().st_size
    merged_bytes = (tmp_path / "merged" / "out" / "weights" / "model.safetensors").stat().st_size
    assert adapter_bytes < merged_bytes / 4
    assert not (weights / "model.safetensors").exists()  # no merged weights were staged


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(lora_sync="adapter"), "--lora-sync='adapter': sends the LoRA adapter: needs --lora-rank"),
        (dict(lora_rank=4, lora_sync="adapter"), "the in-process engine takes the merged weights in memory"),
        (
            dict(lora_rank=4, lora_sync="adapter", rollout_url="http://x:1", weight_transport="http"),
            "--weight-transport disk",
        ),
        (
            dict(lora_rank=4, lora_sync="adapter", rollout_url="http://x:1", async_rollout=True, max_policy_lag=1),
            "requests in flight at every push",
        ),
    ],
)
def test_adapter_sync_settings_that_cannot_hold_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)
