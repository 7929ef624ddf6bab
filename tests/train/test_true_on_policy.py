"""``train --true-on-policy-mode --ci-test``: every token's trainer log-prob is its rollout log mu bit for bit
(tolerance 0), on a dense model and a mixture of experts with routing replay, in float32 and bf16, with the engine
in the trainer's process and as ``serve --deterministic`` over HTTP. CI runs these under all three kernel sets
(marker float_bits): the equality holds by construction there too."""

from __future__ import annotations

import pytest

from processes import engine_process
from recipe_helpers import run_config
from support_replay.train import train

pytestmark = pytest.mark.float_bits

MODELS = ["dense", "moe-r3"]
DTYPES = ["float32", "bfloat16"]


def settings(model: str, dtype: str) -> dict:
    extra = {"use_rollout_routing_replay": True} if model == "moe-r3" else {}
    return dict(true_on_policy_mode=True, rollout_dtype=dtype, train_dtype=dtype, num_rollout=2, **extra)


def assert_bitwise(rows: list[dict]) -> None:
    assert rows and all(r["train_rollout_compared_tokens"] > 0 for r in rows)
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_unequal_tokens"] == 0
        assert r["replay_ratio_mean"] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_in_process(tiny_checkpoint, tiny_moe_checkpoint, tmp_path, model, dtype):
    checkpoint = tiny_moe_checkpoint if model == "moe-r3" else tiny_checkpoint
    assert_bitwise(train(run_config(checkpoint, tmp_path, **settings(model, dtype))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.processes
def test_through_serve(tiny_checkpoint, tiny_moe_checkpoint, tmp_path, model, dtype):
    checkpoint = tiny_moe_checkpoint if model == "moe-r3" else tiny_checkpoint
    ctx, url = engine_process(checkpoint, "--deterministic", "--dtype", dtype)
    with ctx:
        rows = train(run_config(checkpoint, tmp_path, rollout_url=url, **settings(model, dtype)))
    assert_bitwise(rows)
    if model == "moe-r3":
        assert all(0 < r["routing_bytes_per_token"] < 2 * 2 * 4 for r in rows)  # uint8 .npy, not int32
