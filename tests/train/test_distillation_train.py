"""On-policy distillation in process: a teacher beside the actor scores every support id of every model token;
the exact divergence trains, --ci-test still checks the student's replayed log-probs, and a teacher that does not
share the student's tokenizer, vocabulary or template is refused by name."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from processes import engine_process
from recipe_helpers import agent_config, run_config
from support_replay.errors import ConfigError
from support_replay.train import train
from tiny_model import build_tiny_checkpoint, build_tiny_moe_checkpoint, tiny_dims

OPD = dict(use_opd=True)
METRICS = ("opd_divergence", "opd_single_estimate", "opd_teacher_mass", "opd_agreement")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The tiny model's architecture, other weights: the same tokenizer."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("teacher"), seed=1)


def wider_teacher(path, student, head: int | None = None):
    """Twice the student's width and three layers, the student's tokenizer; ``head``: its embeddings padded (or cut)
    to that many rows."""
    tok = AutoTokenizer.from_pretrained(student)
    torch.manual_seed(2)
    dims = {**tiny_dims(tok, 512), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
    dims["vocab_size"] = head or dims["vocab_size"]
    model = Qwen3ForCausalLM(Qwen3Config(**dims, head_dim=32))
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def assert_distilled(rows):
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3  # the student's replay is unchanged
        for name in METRICS:
            assert math.isfinite(r[name]), name
        assert 0 < r["opd_teacher_mass"] <= 1 and 0 <= r["opd_agreement"] <= 1
        assert r["opd_divergence"] >= 0


@pytest.fixture
def distill_calls(monkeypatch):
    """Every ``distill_terms`` call of the learner during a run: ``(the reward's token advantages, log pi_old(a_t) -
    log p_T(a_t), the terms it returned, the micro-batch)``."""
    from support_replay.train import learner

    calls = []
    terms = learner.distill_terms

    def spy(cfg, batch, student_rows, student_full_old, teacher_scores, token_advantages):
        out = terms(cfg, batch, student_rows, student_full_old, teacher_scores, token_advantages)
        _, selected = teacher_scores.rows(batch)
        calls.append((token_advantages.detach().clone(), (student_full_old - selected).detach(), out, batch))
        return out

    monkeypatch.setattr(learner, "distill_terms", spy)
    return calls


@pytest.mark.parametrize("divergence", ["reverse", "forward", "jsd"])
def test_the_exact_divergence_trains_beside_grpo_and_ci_test_holds(tiny_checkpoint, teacher, tmp_path, divergence):
    rows = train(run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load=str(teacher), opd_divergence=divergence))
    assert_distilled(rows)
    assert all(("opd_single_bias" in r) == (divergence == "reverse") for r in rows)  # the estimate is of reverse KL


def test_distillation_alone_moves_the_student_toward_the_teacher(tiny_checkpoint, teacher, tmp_path):
    rows = train(
        run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load=str(teacher), opd_only=True, num_rollout=5)
    )
    assert_distilled(rows)
    assert rows[-1]["opd_divergence"] < rows[0]["opd_divergence"]


def test_the_single_sample_estimator_shapes_the_advantage_and_the_exact_value_is_reported(
    tiny_checkpoint, teacher, tmp_path, distill_calls
):
    """Every micro-batch of a real run under ``--opd-estimator single``: the policy term's advantages are the
    reward's minus ``coef x (log pi_old(a_t) - log p_T(a_t))`` (slime's shaping) and no divergence loss is added;
    the exact divergence on S_t is still computed, and the row's ``opd_divergence`` is its mean over the trained
    tokens (reported, not trained)."""
    calls = distill_calls
    coef = 2.5
    rows = train(
        run_config(
            tiny_checkpoint, tmp_path, **OPD, opd_teacher_load=str(teacher), opd_estimator="single",
            opd_kl_coef=coef, num_rollout=1,
        )
    )  # fmt: skip
    assert_distilled(rows)
    assert calls
    for advantages, single, out, _ in calls:
        assert out.loss is None  # nothing of the divergence's gradient in the loss
        assert torch.equal(out.advantages, advantages - coef * single)  # the shaping, per token
        assert not torch.equal(out.advantages, advantages)
    assert rows[0]["opd_divergence"] == pytest.approx(exact_mean(calls), rel=1e-6)


def exact_mean(calls) -> float:
    """The exact divergence's mean over the trained tokens of the recorded micro-batches."""
    exact = sum(out.sums.exact for _, _, out, _ in calls)
    tokens = sum(float(batch.loss_mask.sum()) for *_, batch in calls)
    assert exact > 0 and tokens > 0
    return exact / tokens


@pytest.mark.parametrize(
    "extra",
    [
        dict(lora_rank=4),
        dict(async_rollout=True, max_policy_lag=1),
        dict(rollout_repetition_penalty=1.3, rollout_presence_penalty=0.2),
        dict(packed_scoring="on"),
        dict(policy_loss="reinforce"),
    ],
    ids=["lora", "async-lag-1", "penalties", "packed", "reinforce"],
)
def test_distillation_with_lora_a_policy_lag_penalties_packing_and_reinforce(tiny_checkpoint, teacher, tmp_path, extra):
    rows = train(run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load=str(teacher), num_rollout=2, **extra))
    assert_distilled(rows)


def test_distillation_on_agent_episodes_scores_only_the_models_tokens(
    tiny_agent_checkpoint, tmp_path_factory, distill_calls
):
    """Agent episodes hold tokens the model did not sample (tool results, the next turn's template): they are in the
    micro-batches (loss mask 0), and the reported divergence is the mean over the model's tokens alone."""
    teacher = build_tiny_checkpoint(tmp_path_factory.mktemp("agent-teacher"), seed=1, max_positions=2048)
    rows = train(
        agent_config(
            tiny_agent_checkpoint, tmp_path_factory.mktemp("run"), agent="chain", **OPD, opd_teacher_load=str(teacher)
        )
    )  # chain: the environment answers every turn, so every episode holds inserted tokens
    assert_distilled(rows)
    assert all(r["episode_turns_mean"] > 1 and r["inserted_token_share"] > 0 for r in rows)
    per_rollout = len(distill_calls) // len(rows)  # in order: the first rollout's calls make its row
    first = distill_calls[:per_rollout]
    assert sum(int((batch.loss_mask == 0).sum()) for *_, batch in first) > 0  # scored rows, out of the loss
    assert rows[0]["opd_divergence"] == pytest.approx(exact_mean(first), rel=1e-6)


@pytest.mark.parametrize("kind", ["wider", "padded", "moe"])
def test_a_wider_or_mixture_of_experts_teacher_with_the_students_tokenizer(tiny_checkpoint, tmp_path, kind):
    """``padded``: the student's tokenizer, its head padded to 448 rows (models pad to a multiple of 64): the same
    token map, and no support id reaches the padding (it was refused for its vocab_size)."""
    path = tmp_path / "teacher"
    if kind == "moe":
        path = build_tiny_moe_checkpoint(path)
    else:
        path = wider_teacher(path, tiny_checkpoint, head=448 if kind == "padded" else None)
    rows = train(run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load=str(path), num_rollout=2))
    assert_distilled(rows)


def test_a_checkpoint_the_run_saved_is_a_teacher(tiny_checkpoint, tmp_path):
    """What `train --save` writes loads as a Hugging Face checkpoint: a teacher trained by support-replay itself."""
    train(run_config(tiny_checkpoint, tmp_path / "teach", num_rollout=2, save=str(tmp_path / "ckpt"), save_interval=2))
    saved = tmp_path / "ckpt" / "rollout_000002"
    rows = train(run_config(tiny_checkpoint, tmp_path / "student", **OPD, opd_teacher_load=str(saved), num_rollout=2))
    assert_distilled(rows)


def test_a_teacher_with_another_vocabulary_or_template_is_refused_by_name(tiny_checkpoint, tmp_path):
    narrower = wider_teacher(tmp_path / "narrow", tiny_checkpoint, head=320)  # the student's ids 320.. have no row
    with pytest.raises(ConfigError, match="--opd-teacher-load=.*vocabulary of 320 ids, the student's has 384"):
        train(run_config(tiny_checkpoint, tmp_path / "a", **OPD, opd_teacher_load=str(narrower)))
    other_vocab = build_tiny_checkpoint(tmp_path / "vocab", vocab_size=400)
    with pytest.raises(ConfigError, match="--opd-teacher-load=.*maps tokens to other ids"):
        train(run_config(tiny_checkpoint, tmp_path / "a2", **OPD, opd_teacher_load=str(other_vocab)))
    other_template = build_tiny_checkpoint(tmp_path / "template", chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(ConfigError, match="--opd-teacher-load=.*chat template"):
        train(run_config(tiny_checkpoint, tmp_path / "b", **OPD, opd_teacher_load=str(other_template)))
    with pytest.raises(ConfigError, match="--opd-teacher-load=.*not a checkpoint directory"):
        train(run_config(tiny_checkpoint, tmp_path / "c", **OPD, opd_teacher_load=str(tmp_path / "none")))


def test_the_config_rules_of_distillation(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--use-opd=True: scores the teacher on each token's replayed support"):
        run_config(
            tiny_checkpoint, tmp_path, **OPD, opd_teacher_load="t", rollout_top_p=1.0, rollout_top_k=-1, ci_test=False
        )
    with pytest.raises(ConfigError, match="--opd-teacher-load=None: --use-opd needs a teacher"):
        run_config(tiny_checkpoint, tmp_path, **OPD)
    with pytest.raises(ConfigError, match="--opd-kl-coef=0.5: has no effect without --use-opd"):
        run_config(tiny_checkpoint, tmp_path, opd_kl_coef=0.5)
    with pytest.raises(ConfigError, match="--opd-divergence='jsd': the single-sample estimator"):
        run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load="t", opd_estimator="single", opd_divergence="jsd")
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size=2: with --use-opd"):
        run_config(tiny_checkpoint, tmp_path, **OPD, opd_teacher_load="t", tensor_model_parallel_size=2)


@pytest.mark.processes
def test_a_teacher_served_by_serve_gives_what_the_in_process_teacher_gives(tiny_checkpoint, teacher, tmp_path):
    """The same teacher over HTTP (/score_support) and beside the actor: the same rollout, the same divergence."""
    ctx, url = engine_process(teacher)
    with ctx:
        served = train(run_config(tiny_checkpoint, tmp_path / "served", **OPD, opd_teacher_url=url, num_rollout=1))
        reply = httpx.post(
            url + "/score_support", json={"input_ids": [1, 2, 3], "response_start": 1, "support_ids": [[5]]}
        )
        assert reply.status_code == 400 and "support_ids: 1 lists for 2 response positions" in reply.text
        reply = httpx.post(
            url + "/score_support", json={"input_ids": [1, 2], "response_start": 1, "support_ids": [[5]], "top_k": 3}
        )
        assert reply.status_code == 400 and "top_k" in reply.text  # a field we do not implement, by name
    local = train(run_config(tiny_checkpoint, tmp_path / "local", **OPD, opd_teacher_load=str(teacher), num_rollout=1))
    assert_distilled(served)
    for name in METRICS:
        assert served[0][name] == pytest.approx(local[0][name], rel=1e-4, abs=1e-6), name


@pytest.mark.processes
def test_a_served_teacher_with_another_tokenizer_is_refused_by_name(tiny_checkpoint, tmp_path):
    other = build_tiny_checkpoint(tmp_path / "other", chat_template="{{ messages[0]['content'] }}")
    ctx, url = engine_process(other)
    with ctx, pytest.raises(ConfigError, match="--opd-teacher-url=.*its tokenizer"):
        train(run_config(tiny_checkpoint, tmp_path / "run", **OPD, opd_teacher_url=url, num_rollout=1))


def test_sglangs_own_server_as_the_teacher_through_its_token_ids_logprob(tiny_checkpoint, sglang_server, tmp_path):
    """SGLang 0.5.23 scores one id list per request at every position: the union of the sample's support ids is
    sent, each position's own read out; the divergence is the in-process teacher's (the same checkpoint)."""
    url, checkpoint = sglang_server
    served = train(run_config(tiny_checkpoint, tmp_path / "sglang", **OPD, opd_teacher_url=url, num_rollout=1))
    local = train(
        run_config(tiny_checkpoint, tmp_path / "local", **OPD, opd_teacher_load=str(checkpoint), num_rollout=1)
    )
    assert_distilled(served)
    for name in METRICS:
        assert served[0][name] == pytest.approx(local[0][name], rel=1e-4, abs=1e-5), name
    row = served[0]
    assert row["opd_teacher_ids_sent"] > row["opd_teacher_ids_needed"] > 0  # the union costs more than the supports


def test_an_sglang_teacher_is_asked_with_every_sampling_field_neutral(tiny_checkpoint, tmp_path):
    """SGLang 0.5.23 fills a field a request leaves out from the model's generation_config.json (``--sampling-defaults
    model``, its default: configs/model_config.py's get_default_sampling_params reads repetition_penalty,
    temperature, top_k, top_p, min_p): a teacher whose config sets top_p 0.5 would be asked for a renormalised
    distribution. Every field is sent, neutral. (Answered HTTP 500 here: the request is what is checked.)"""
    import json
    import shutil
    from types import SimpleNamespace

    from support_replay.core.support import SupportTable
    from support_replay.errors import SampleError
    from support_replay.train.remote_teacher import RemoteTeacher

    served = tmp_path / "teacher"
    shutil.copytree(tiny_checkpoint, served)
    (served / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "top_k": 4, "repetition_penalty": 1.3}))
    sent = []

    def sglang(request):
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"model_path": str(served), "tokenizer_path": str(served)})
        sent.append(json.loads(request.content))
        return httpx.Response(500, text="checked")

    teacher = RemoteTeacher("http://sglang", tiny_checkpoint, 384, transport=httpx.MockTransport(sglang))
    sample = SimpleNamespace(
        index=0, prompt_ids=[5, 6], response_ids=[7, 8], support=SupportTable.from_lists([[7, 9], [8]])
    )
    with pytest.raises(SampleError, match="HTTP 500"):
        teacher.score_sample(sample)
    assert sent[0]["sampling_params"] == {
        "max_new_tokens": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    assert sent[0]["token_ids_logprob"] == [7, 8, 9] and sent[0]["logprob_start_len"] == 1
