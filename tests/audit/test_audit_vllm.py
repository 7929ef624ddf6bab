"""The audit against the real vLLM CPU server (the session's ``vllm_server``), whose model's
generation_config.json sets a top_k (``tiny_model.VLLM_DEFAULT_TOP_K``): vLLM applies it to a
/v1/completions request that leaves top_k out. A run that declares no top_k, audited with a client that
sends only what it sets, must have it named; with every setting sent it must pass."""

import pytest

from support_replay.audit import AuditSettings, run_audit
from support_replay.train.config import RunConfig
from tiny_model import VLLM_DEFAULT_TOP_K

pytestmark = pytest.mark.slow


def vllm_audit(vllm_server, tmp_path, **overrides) -> RunConfig:
    url, checkpoint = vllm_server
    values = dict(
        hf_checkpoint=str(checkpoint),
        rollout_url=url,
        rollout_engine="vllm",
        vllm_endpoint="completions",
        rollout_top_k=-1,  # the run declares no filter at all
        rollout_top_p=1.0,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        global_batch_size=8,
        rollout_max_response_len=12,
        output_dir=str(tmp_path / "audit"),
        progress=False,
    )
    return RunConfig(**{**values, **overrides})


def test_a_generation_config_top_k_is_named_and_neutralised(vllm_server, tmp_path):
    cfg = vllm_audit(vllm_server, tmp_path)
    report = run_audit(cfg, AuditSettings())
    assert report["engine"]["name"] == "vllm" and report["engine"]["version"].startswith("0.32")
    assert report["settings"]["sent"] == []  # nothing differs from the neutral values: nothing is sent
    named = [f for f in report["findings"] if f["setting"] == "top_k"]
    assert named and f"top_k={VLLM_DEFAULT_TOP_K}" in named[0]["evidence"], report["findings"]
    assert report["settings"]["observed"]["support"]["support_max"] == VLLM_DEFAULT_TOP_K
    assert report["causes"]["truncation"]["share"] > 0.9  # what the undeclared filter removed
    assert not report["verdict"]["pass"]

    neutral = run_audit(cfg, AuditSettings(send_neutral_sampling_settings=True))
    assert neutral["findings"] == [] and neutral["verdict"]["pass"], neutral["verdict"]
    assert neutral["settings"]["observed"]["support"]["support_max"] > VLLM_DEFAULT_TOP_K
    assert neutral["causes"]["truncation"]["max_abs"] < 1e-5  # the whole vocabulary is the support (rounding)
