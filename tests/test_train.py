"""End-to-end GRPO runs on the tiny model: --ci-test, KL, the regression harness, resume, FSDP2."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from processes import engine_process, free_port
from support_replay import full_logprobs
from support_replay.config import RunConfig
from support_replay.train import CITestError, train
from support_replay.train import trainer as trainer_module

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).parent))


def run_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    values = dict(
        hf_checkpoint=str(checkpoint), num_rollout=5, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4,
        micro_batch_size=2, rollout_max_response_len=10, lr=1e-3, custom_rm_path="rewards_for_tests:digit_share",
        output_dir=str(tmp_path / "out"), progress=False, ci_test=True, rollout_top_p=0.8, rollout_top_k=32,
    )
    values.update(overrides)
    return RunConfig(**values).check()


def test_five_updates_through_the_http_engine_pass_ci_test(tiny_checkpoint, tmp_path):
    ctx, url = engine_process(tiny_checkpoint)
    with ctx:
        rows = train(run_config(tiny_checkpoint, tmp_path, rollout_url=url, eval_interval=2, n_eval_prompts=3))
        import httpx

        assert httpx.get(url + "/model_info").json()["weight_version"] == 5  # synced after every update
    assert [r["rollout"] for r in rows] == list(range(5))
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and 0.999 < r["replay_ratio_mean"] < 1.001
    # before the policy sharpens, top-p truncates: full-vocabulary scoring would be off by the kept mass
    assert rows[0]["support_mean"] > 1 and rows[0]["full_vocab_ratio_mean"] < 0.95
    assert any(abs(r["loss"]) > 0 for r in rows) and (tmp_path / "out" / "metrics.png").exists()
    # evaluation (capture off, greedy) every 2 rollouts, logged beside the training metrics
    assert [r["rollout"] for r in rows if "eval_reward_mean" in r] == [1, 3]
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 5


def test_kl_loss_equals_an_independent_full_vocabulary_computation(tiny_checkpoint, tmp_path, monkeypatch):
    captured = {}
    original = trainer_module.Trainer.rollout

    def keep(self, r):
        samples = original(self, r)
        captured[r] = samples
        return samples

    monkeypatch.setattr(trainer_module.Trainer, "rollout", keep)
    cfg = run_config(tiny_checkpoint, tmp_path, num_rollout=2, global_batch_size=8, micro_batch_size=4, use_kl_loss=True,
                     kl_loss_coef=0.5, save=str(tmp_path / "ckpt"), save_interval=1)
    rows = train(cfg)
    # rollout 1 is scored with the weights after update 0, which checkpoint rollout_000001 holds
    actor = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    actor.load_state_dict({k: v.double() for k, v in load_file(str(tmp_path / "ckpt" / "rollout_000001" / "model.safetensors")).items()}, strict=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64)
    kls = []
    for s in captured[1]:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        p0 = len(s.prompt_ids) - 1
        with torch.no_grad():
            lp = torch.log_softmax(actor(ids).logits[0, p0 : p0 + s.response_length], -1)
            lr = torch.log_softmax(ref(ids).logits[0, p0 : p0 + s.response_length], -1)
        t = torch.tensor(s.response_ids)[:, None]
        x = lp.gather(1, t) - lr.gather(1, t)
        kls.append(torch.exp(-x) + x - 1)
    independent = float(torch.cat(kls).mean())
    # one optimizer step per rollout: scoring was fused into the update, metrics still complete
    assert rows[0]["full_vocab_ratio_mean"] < 0.95 and 0.999 < rows[0]["replay_ratio_mean"] < 1.001
    assert independent > 1e-6  # the actor has moved away from the reference
    assert rows[1]["kl_loss"] == pytest.approx(independent, rel=1e-4, abs=1e-7)


def test_old_logprobs_from_the_rollout_and_tis(tiny_checkpoint, tmp_path):
    rows = train(run_config(tiny_checkpoint, tmp_path, num_rollout=2, use_rollout_logprobs=True, use_tis=True, entropy_coef=0.01))
    assert all(np.isfinite(r["loss"]) and r["entropy"] > 0 for r in rows)


def test_regression_full_vocabulary_scoring_fails_ci_test(tiny_checkpoint, tmp_path, monkeypatch):
    from support_replay.train import actor

    monkeypatch.setattr(actor, "support_logprobs", lambda rows, targets, support, t: full_logprobs(rows, targets, t))
    monkeypatch.setattr(actor.ScoringModel, "__init__", _without_sparse_head(actor.ScoringModel.__init__))
    # global batch = the whole rollout: the update's own forward is the scored one (fused)
    with pytest.raises(CITestError, match=r"--ci-test failed at rollout 0, sample \d+, response position \d+"):
        train(run_config(tiny_checkpoint, tmp_path, global_batch_size=8))


def _without_sparse_head(init):
    def patched(self, hf, batch_invariant=False):
        init(self, hf, batch_invariant)
        self.plain_head = False  # route scoring through dense logits, where the patch applies

    return patched


def corrupt_one_position(monkeypatch, at_rollout: int, edit) -> dict:
    """Rewrite one support row of one sample of one rollout; returns where (filled when it ran).

    ``edit(row, selected) -> row`` must keep the selected token, so validation still passes
    and only --ci-test can see the change.
    """
    original = trainer_module.Trainer.rollout
    where = {}

    def corrupt(self, r):
        samples = original(self, r)
        if r == at_rollout:
            s = next(x for x in samples if (x.support.sizes() > 1).any())
            t = int(np.flatnonzero(s.support.sizes() > 1)[0])
            rows = s.support.to_lists()
            rows[t] = edit(rows[t], s.response_ids[t])
            s.support = type(s.support).from_lists(rows)
            where.update(t=t, sample=s.index)
        return samples

    monkeypatch.setattr(trainer_module.Trainer, "rollout", corrupt)
    return where


def test_regression_one_corrupted_support_position_fails_ci_test(tiny_checkpoint, tmp_path, monkeypatch):
    where = corrupt_one_position(monkeypatch, 2, lambda row, selected: [selected])  # truncate to the singleton
    with pytest.raises(CITestError) as err:
        train(run_config(tiny_checkpoint, tmp_path))
    assert f"rollout 2, sample {where['sample']}, response position {where['t']}:" in str(err.value)
    assert "1 tokens over" in str(err.value)


def test_true_on_policy_five_updates_are_bitwise_equal(tiny_checkpoint, tmp_path):
    rows = train(run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True))
    assert len(rows) == 5
    for r in rows:  # every token of every rollout, before each update
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_unequal_tokens"] == 0
        assert r["replay_ratio_mean"] == 1.0


def test_true_on_policy_catches_one_corrupted_position(tiny_checkpoint, tmp_path, monkeypatch):
    def drop_one_id(row, selected):
        dropped = max(i for i in row if i != selected)
        return [i for i in row if i != dropped]

    where = corrupt_one_position(monkeypatch, 1, drop_one_id)
    with pytest.raises(CITestError) as err:
        train(run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True, global_batch_size=8, micro_batch_size=4))
    assert f"rollout 1, sample {where['sample']}, response position {where['t']}:" in str(err.value)
    assert "> tolerance 0;" in str(err.value) and "1 tokens over" in str(err.value)


def test_resume_continues_exactly(tiny_checkpoint, tmp_path):
    full = run_config(tiny_checkpoint, tmp_path / "a", num_rollout=4, save=str(tmp_path / "a" / "ckpt"), save_interval=2)
    train(full)
    first = run_config(tiny_checkpoint, tmp_path / "b", num_rollout=2, save=str(tmp_path / "b" / "ckpt"), save_interval=2)
    train(first)
    resumed = run_config(tiny_checkpoint, tmp_path / "b", num_rollout=4, save=str(tmp_path / "b" / "ckpt"), save_interval=2, resume=True)
    rows = train(resumed)
    assert [r["rollout"] for r in rows] == [0, 1, 2, 3]
    a = load_file(str(tmp_path / "a" / "ckpt" / "rollout_000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "ckpt" / "rollout_000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    ra = [json.loads(x) for x in (tmp_path / "a" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rows]


def _fsdp_worker(rank, world, port, checkpoint, out, results, global_batch, micro_batch):
    # Gradient clipping off: its global norm is reduced in another order over shards, which
    # moves the result by an ulp that Adam then amplifies (to ~2e-6 after 3 updates).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(Path(__file__).parent))
    cfg = run_config(checkpoint, Path(out), num_rollout=3, save=str(Path(out) / "ckpt"), save_interval=3, clip_grad=0.0, global_batch_size=global_batch, micro_batch_size=micro_batch)
    rows = train(cfg)
    results[rank] = [r["loss"] for r in rows] if rank == 0 else "ok"


# two optimizer steps per rollout; or one, with the old-policy scoring fused into it
@pytest.mark.parametrize("global_batch, micro_batch", [(4, 2), (8, 4)])
def test_two_fsdp_ranks_equal_one(tiny_checkpoint, tmp_path, global_batch, micro_batch):
    manager = mp.Manager()
    results = {}
    for world in (1, 2):
        res = manager.dict()
        args = (world, free_port(), str(tiny_checkpoint), str(tmp_path / f"w{world}"), res, global_batch, micro_batch)
        mp.spawn(_fsdp_worker, args=args, nprocs=world, join=True)
        results[world] = dict(res)
    np.testing.assert_allclose(results[2][0], results[1][0], atol=1e-6, rtol=0)
    one = load_file(str(tmp_path / "w1" / "ckpt" / "rollout_000003" / "model.safetensors"))
    two = load_file(str(tmp_path / "w2" / "ckpt" / "rollout_000003" / "model.safetensors"))
    for k in one:
        # each rank runs exactly one of the single process's micro-batches, so the summed
        # gradients, hence the weights, are equal bit for bit. (With several micro-batches
        # per rank the sum associates differently, (g0+g1)+(g2+g3) against ((g0+g1)+g2)+g3,
        # and Adam amplifies that last-bit difference: about 2e-5 after 3 updates.)
        assert torch.equal(two[k], one[k]), k
