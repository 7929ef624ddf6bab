"""GRPO with --ci-test through external engines: a server answering as SGLang 0.5.23 does (its own
sampler and payload code), smg in front of two real SGLang servers (in front of our engines: tests/test_ray_run.py),
real SGLang with penalties, and a real vLLM server."""

import sys

import httpx
import pytest

from processes import engine_process, free_port, process, sglang_standin_process
from recipe_helpers import run_config
from support_replay.backends.weight_push import ADAPTER_NAME
from support_replay.errors import ConfigError, SupportReplayError
from support_replay.launch import wait_smg_workers
from support_replay.train import train

pytestmark = pytest.mark.slow


@pytest.mark.processes
def test_grpo_through_a_server_answering_as_sglang(tiny_checkpoint, tmp_path):
    standin, url = sglang_standin_process(tiny_checkpoint)
    with standin:
        rows = train(run_config(tiny_checkpoint, tmp_path, rollout_url=url))
        assert httpx.get(url + "/model_info").json()["weight_version"] == "3"
    for r in rows:  # SGLang's own log(w_sel / sum w) against our trainer's support log-probs
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and 0.999 < r["replay_ratio_mean"] < 1.001
        assert r["policy_lag_max"] == 0 and r["support_bytes_per_token"] > 0
    assert rows[0]["support_mean"] > 1


def smg_router(worker_urls: list[str]):
    port, metrics = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics),
        "--enable-rl",
        "--log-level",
        "warn",
    ]
    return process(args, url), url


def test_grpo_through_real_vllm_with_weight_sync(vllm_server, tmp_path):
    url, ckpt = vllm_server
    try:
        rows = train(run_config(ckpt, tmp_path, rollout_url=url, rollout_engine="vllm"))
        assert httpx.get(url + "/weight_info").json()["weight_version"] == "3"  # synced after every update
    finally:  # the server is shared by the session: give it back its own weights
        from safetensors.torch import load_file

        from support_replay.backends.vllm_weights import VLLMSync

        VLLMSync(url, tmp_path / "restore").push(load_file(str(ckpt / "model.safetensors")), "default")
    for r in rows:  # every rollout after the first was sampled by weights reloaded from the trainer
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and 0.999 < r["replay_ratio_mean"] < 1.001
        assert r["policy_lag_max"] == 0
    assert rows[0]["support_mean"] > 1
    assert any(abs(r["loss"]) > 0 for r in rows)


def test_lora_adapters_alone_through_real_vllm(vllm_server, tmp_path):
    """--lora-sync adapter: vLLM loads the adapter in place (/v1/load_lora_adapter) and computes W x + B A x as the
    trainer does; every rollout within --ci-test's bound, the base model untouched."""
    url, ckpt = vllm_server
    lora = dict(lora_rank=4, lora_alpha=8.0, lr=2e-3, lora_sync="adapter")
    try:
        rows = train(run_config(ckpt, tmp_path, rollout_url=url, rollout_engine="vllm", **lora))
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ADAPTER_NAME in models and httpx.get(url + "/weight_info").json()["weight_version"] == "3"
    finally:  # the server is shared by the session: the adapter goes, the base model stays as it was
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER_NAME})
        httpx.post(url + "/update_weight_version", json={"new_version": "default"})
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["policy_lag_max"] == 0
    assert all(r["grad_norm"] > 0 for r in rows)  # the adapter trained on every rollout
    staged = sorted(p.name for p in (tmp_path / "out" / "weights").iterdir())
    assert staged == ["adapter-3"]  # the adapter alone was staged, never the merged weights


def test_grpo_with_penalties_through_real_vllm(vllm_server, tmp_path):
    """vLLM 0.32's own penalties and logit bias, replayed by the trainer with its rules."""
    url, ckpt = vllm_server
    bias = tmp_path / "bias.json"
    bias.write_text('{"5": -2.0, "17": 1.5}')
    try:
        rows = train(
            run_config(
                ckpt,
                tmp_path,
                rollout_url=url,
                rollout_engine="vllm",
                num_rollout=2,
                rollout_max_response_len=24,
                rollout_repetition_penalty=1.3,
                rollout_frequency_penalty=0.4,
                rollout_presence_penalty=0.2,
                rollout_logit_bias=str(bias),
            )
        )
    finally:
        from safetensors.torch import load_file

        from support_replay.backends.vllm_weights import VLLMSync

        VLLMSync(url, tmp_path / "restore").push(load_file(str(ckpt / "model.safetensors")), "default")
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


def test_agent_episodes_through_real_vllm(vllm_server, tmp_path):
    """Sessions in front of the real vLLM server: multi-turn chain episodes, --ci-test per token."""
    from recipe_helpers import agent_config

    url, ckpt = vllm_server
    try:
        rows = train(
            agent_config(ckpt, tmp_path, agent="chain", rollout_url=url, rollout_engine="vllm", max_episode_tokens=120)
        )
    finally:
        from safetensors.torch import load_file

        from support_replay.backends.vllm_weights import VLLMSync

        VLLMSync(url, tmp_path / "restore").push(load_file(str(ckpt / "model.safetensors")), "default")
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["policy_lag_max"] == 0 for r in rows)
    assert rows[0]["episode_turns_mean"] > 1 and rows[0]["inserted_token_share"] > 0


def restore_sglang(url: str, ckpt, tmp_path) -> None:
    """The SGLang server is shared by the session: give it back its own weights."""
    from safetensors.torch import load_file

    from support_replay.backends.sglang_weights import SGLangSync

    SGLangSync(url, tmp_path / "restore").push(load_file(str(ckpt / "model.safetensors")), "default")


def test_grpo_through_smg_in_front_of_two_real_sglang_servers(sglang_servers, tmp_path):
    """GRPO with --ci-test through smg in front of two SGLang 0.5.23 servers: their sampler's log mu on each
    token's support against our trainer's support log-probs, weights pushed after every update through smg's RL
    fan-out to each server's own /update_weights_from_disk."""
    pytest.importorskip("smg", reason="smg (PyPI) is not installed")
    urls, ckpt = [server.url for server in sglang_servers], sglang_servers[0].checkpoint
    before = [server.generate_calls() for server in sglang_servers]
    ctx, url = smg_router(urls)
    try:
        with ctx:
            workers = wait_smg_workers(url, 2, timeout=30)  # smg registers a worker after probing it
            assert {w["engine"] for w in workers} == {"sglang"} and {w["url"] for w in workers} == set(urls)
            rows = train(run_config(ckpt, tmp_path, rollout_url=url, rollout_engine="sglang"))
            # both servers sampled, and both hold the trainer's last weights under its name
            served = [server.generate_calls() - calls for server, calls in zip(sglang_servers, before)]
            versions = [httpx.get(u + "/model_info", timeout=30).json()["weight_version"] for u in urls]
    finally:
        for u in urls:
            restore_sglang(u, ckpt, tmp_path)
    assert versions == ["3", "3"]
    assert min(served) > 0, f"smg sent {served} /generate calls to the two servers"
    for r in rows:  # every rollout after the first was sampled by weights the trainer pushed
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and 0.999 < r["replay_ratio_mean"] < 1.001
        assert r["policy_lag_max"] == 0
    assert rows[0]["support_mean"] > 1 and any(abs(r["loss"]) > 0 for r in rows)


@pytest.mark.parametrize(
    "penalties",
    [
        dict(rollout_frequency_penalty=0.4, rollout_presence_penalty=0.2),
        dict(rollout_repetition_penalty=1.3),
    ],
    ids=["frequency-presence-bias", "repetition-bias"],
)
def test_grpo_with_penalties_through_real_sglang(sglang_server, tmp_path, penalties):
    """SGLang 0.5.23's own penalties and logit bias, replayed by the trainer with its rules (docs/math.md)."""
    url, ckpt = sglang_server
    bias = tmp_path / "bias.json"
    bias.write_text('{"5": -2.0, "17": 1.5}')
    cfg = run_config(
        ckpt,
        tmp_path,
        rollout_url=url,
        rollout_engine="sglang",
        num_rollout=2,
        rollout_max_response_len=24,
        rollout_logit_bias=str(bias),
        **penalties,
    )
    try:
        rows = train(cfg)
    finally:
        restore_sglang(url, ckpt, tmp_path)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


def test_the_repetition_penalty_beside_another_is_refused_for_sglang(sglang_server, tmp_path):
    """Without overlap scheduling SGLang 0.5.23 applies its penalizers in a set's iteration order, which changes
    between its starts (seen here: the same requests replayed additive-then-scaling on one start and
    scaling-then-additive on another): the trainer cannot know it, so the run is refused before it samples."""
    url, ckpt = sglang_server
    cfg = run_config(ckpt, tmp_path, rollout_url=url, rollout_repetition_penalty=1.3, rollout_presence_penalty=0.2)
    with pytest.raises(ConfigError, match="the repetition penalty with a frequency or presence penalty has no"):
        train(cfg)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_agent_episodes_through_real_sglang(sglang_server, tmp_path):
    """Sessions in front of SGLang 0.5.23 itself: each turn a /generate with input_ids, --ci-test per token."""
    from recipe_helpers import agent_config

    url, ckpt = sglang_server
    try:
        rows = train(agent_config(ckpt, tmp_path, agent="chain", rollout_url=url, max_episode_tokens=120))
    finally:
        restore_sglang(url, ckpt, tmp_path)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["policy_lag_max"] == 0 for r in rows)
    assert rows[0]["episode_turns_mean"] > 1 and rows[0]["inserted_token_share"] > 0


@pytest.mark.processes
def test_an_engine_that_would_compute_other_bits_is_refused_before_anything_trains(tiny_checkpoint, tmp_path):
    """A served engine in another dtype, or not deterministic, is refused by name before the first rollout."""
    ctx, url = engine_process(tiny_checkpoint, "--deterministic", "--dtype", "bfloat16")
    with ctx, pytest.raises(SupportReplayError, match="computes in bfloat16, this trainer in float32"):
        train(run_config(tiny_checkpoint, tmp_path / "dtype", rollout_url=url, true_on_policy_mode=True))
    ctx, url = engine_process(tiny_checkpoint)
    with ctx, pytest.raises(SupportReplayError, match="is not deterministic; start it with `support-replay serve"):
        train(run_config(tiny_checkpoint, tmp_path / "plain", rollout_url=url, true_on_policy_mode=True))
