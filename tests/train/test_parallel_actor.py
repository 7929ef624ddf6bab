"""The actor split over 4 gloo processes (TP=2 x DP=2, CP=2 x DP=2 zigzag and contiguous) against
one process: scores, gradients and the updated weights of one step, then a GRPO run with
--ci-test in each layout.

Not bitwise: a row-parallel projection sums its halves in another order than one matmul, the
vocab-parallel log-softmax reduces its maximum and sums per shard, and the context-parallel
attention runs products of other shapes than the one-rank attention, so values differ in the
last bits (measured here: scores within a few ulps, 3e-7 relative; gradients within 1e-5 of each
tensor's largest element, where sums cancel). The tolerances say so.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from processes import free_port
from support_replay import SupportTable
from support_replay.core.losses import token_weights
from support_replay.rollout.sample import Sample
from support_replay.train.actor import Actor
from support_replay.train.batches import plan_optimizer_steps
from support_replay.train.dist import DistContext, gather_by_index, init_distributed
from support_replay.train.layout import parallel_layout
from support_replay.train.scorer import Outputs

pytestmark = pytest.mark.slow
LAYOUTS = [dict(tp=2), dict(cp=2, cp_layout="zigzag"), dict(cp=2, cp_layout="contiguous")]
TEMPERATURE = 0.9
LR = 1e-3


def make_samples(vocab: int, n: int = 8, seed: int = 0, routing_shape=None) -> list[Sample]:
    """Random samples; with a ``routing_shape`` (a MoE model) each carries a random valid routing to replay."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(3, 9)) if i > 1 else 40).tolist()
        # samples 0 and 1 (one micro-batch): long prompts, short responses, so that in the contiguous
        # layout one CP rank holds no response row of that micro-batch at all
        response = rng.integers(0, vocab, int(rng.integers(2, 12)) if i > 1 else 2).tolist()
        rows = [sorted({t, *rng.integers(0, vocab, int(rng.integers(0, 6))).tolist()}) for t in response]
        mask = np.ones(len(response), np.int8)
        mask[: i % 3] = 0  # some tokens out of the loss
        samples.append(
            Sample(
                index=i,
                group=i // 4,
                prompt_ids=prompt,
                response_ids=response,
                loss_mask=mask,
                support=SupportTable.from_lists(rows),
                log_mu=np.zeros(len(response), np.float32),
            )
        )
        if routing_shape is not None:
            k, layers, experts = routing_shape.top_k, routing_shape.layers, routing_shape.num_experts
            positions = len(prompt) + len(response) - 1
            picks = np.argsort(rng.random((positions, layers, experts)), -1)[..., :k]
            samples[-1].routing = picks.astype(np.int32)
    return samples


def _row_spans(valid: torch.Tensor, lengths) -> list[slice]:
    """Each sample's slice of the flat valid support entries (padding-free, so layouts compare)."""
    counts = valid.sum(-1)
    ends = torch.cumsum(torch.stack([c.sum() for c in torch.split(counts, list(lengths))]), 0).tolist()
    return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends)]


def actor_for(name: str, checkpoint, ctx, layout=None) -> Actor:
    """The actor of a test model; a MoE one replays the samples' routing."""
    return Actor(
        checkpoint,
        ctx,
        lr=LR,
        betas=(0.9, 0.98),
        weight_decay=0.0,
        replay=True,
        full_with_grad=True,
        layout=layout,
        routing_replay="moe" in name,
    )


def one_step(actor: Actor, samples, rank: int, world: int, ctx) -> tuple[list, dict, dict]:
    """Scores, full gradients and full updated weights after one AdamW step on all samples."""
    step = plan_optimizer_steps(
        samples,
        global_batch=len(samples),
        micro_batch=2,
        rank=rank,
        world=world,
        replay=True,
        device=torch.device("cpu"),
    )[0]
    scores = {}
    for mb in step.micro_batches:
        sc = actor.score(mb, TEMPERATURE, Outputs(full=True, entropy=True, support_rows=True))
        w = token_weights(mb.loss_mask, mb.lengths, "token", batch_tokens=step.tokens, batch_sequences=step.sequences)
        valid = mb.support[1]
        # every support id's log-prob with a gradient (score centering's term): the vocab-parallel gather under TP
        rows = (sc.support_logp * valid * torch.linspace(0.1, 0.3, valid.shape[1])).sum(-1)
        actor.backward(((sc.logp + 0.5 * sc.full - 0.1 * sc.entropy + 0.2 * rows) * w).sum())
        ids = [sc.support_logp[valid].detach()[s] for s in _row_spans(valid, mb.lengths)]
        scores.update(
            {
                i: (lp.detach(), f.detach(), r)
                for i, lp, f, r in zip(mb.indices, mb.split(sc.logp), mb.split(sc.full), ids)
            }
        )
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in actor.model.named_parameters()
    }
    actor.optimizer.step()
    return gather_by_index(scores, len(samples), ctx), grads, actor.full_state_dict()


def _worker(rank, world, port, checkpoints, results):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    sys.path.insert(0, str(Path(__file__).parents[1]))
    torch.set_num_threads(1)
    ctx = init_distributed()
    for name, checkpoint in checkpoints.items():
        for i, spec in enumerate(LAYOUTS):
            layout = parallel_layout(ctx, **spec)
            torch.manual_seed(0)
            actor = actor_for(name, checkpoint, ctx, layout)
            samples = make_samples(actor.vocab_size, routing_shape=actor.routing_shape)
            scores, grads, state = one_step(actor, samples, layout.dp_rank, layout.dp, ctx)
            if rank == 0:
                results[name, i] = (scores, {k: v.cpu() for k, v in grads.items()}, state)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory):
    from tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-tied"), llama_tied=True)


@pytest.mark.processes
def test_four_ranks_in_each_layout_give_one_rank_s_scores_gradients_and_weights(
    tiny_checkpoint, tiny_llama_tied, tiny_moe_checkpoint
):
    """Qwen3 (per-head norms, untied head), Llama with a tied embedding (SmolLM2's shape), and Qwen3-MoE
    replaying a routing (tensor parallel: attention split, the sparse blocks whole on every rank)."""
    checkpoints = {
        "qwen3": str(tiny_checkpoint),
        "llama-tied": str(tiny_llama_tied),
        "qwen3-moe": str(tiny_moe_checkpoint),
    }
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(4, free_port(), checkpoints, results), nprocs=4, join=True)
    one = DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)
    for name, checkpoint in checkpoints.items():
        actor = actor_for(name, checkpoint, one)
        ref_scores, ref_grads, _ = one_step(
            actor, make_samples(actor.vocab_size, routing_shape=actor.routing_shape), 0, 1, one
        )
        ref_state = {k.removeprefix("hf."): v for k, v in actor.model.state_dict().items()}
        for i, spec in enumerate(LAYOUTS):
            spec = {"model": name, **spec}
            scores, grads, state = results[name, i]
            # a split product adds its partial sums in another order than one rank's: last-bit differences that
            # the layers after it carry on. Measured at worst: dense 1e-6 on AVX-512 EPYCs, 4.8e-6 (qwen3, tp 2) on a
            # Zen 3 EPYC (AVX2 kernels); the MoE, whose expert products take them through two more layers of
            # products (its routing replayed, so no expert changes), 1.4e-6 on AVX-512
            tol = 1e-5
            for (lp, f, rows), (ref_lp, ref_f, ref_rows) in zip(scores, ref_scores):
                torch.testing.assert_close(
                    lp, ref_lp, rtol=tol, atol=tol, msg=lambda m: f"{spec}: support log-probs: {m}"
                )
                torch.testing.assert_close(
                    rows, ref_rows, rtol=tol, atol=tol, msg=lambda m: f"{spec}: every support id's log-prob: {m}"
                )
                torch.testing.assert_close(
                    f, ref_f, rtol=tol, atol=tol, msg=lambda m: f"{spec}: full-vocabulary log-probs: {m}"
                )
            assert grads.keys() == ref_grads.keys(), spec  # a tied embedding stays one parameter
            for key, g in ref_grads.items():  # elementwise sums that cancel: measured against the tensor's scale
                err = float((grads[key] - g).abs().max() / g.abs().max())
                assert err <= 1e-5, f"{spec}: gradient of {key}: max error {err:.2e} of its largest element"
            # one AdamW step: lr x g / (|g| + eps) moves each weight by about lr; an expert weight whose gradient
            # is nearly 0 (one token routed to it) turns the gradient's last-bit difference into a larger share
            # of that step (measured: 1.2e-5 at one of 32768 elements)
            step_tol = LR * (5e-2 if "moe" in name else 1e-2)
            for key, w in state.items():
                torch.testing.assert_close(
                    w, ref_state[key], rtol=0, atol=step_tol, msg=lambda m: f"{spec}: updated {key}: {m}"
                )


def _train_worker(rank, world, ports, checkpoint, out, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    sys.path.insert(0, str(Path(__file__).parents[1]))
    torch.set_num_threads(1)
    from recipe_helpers import run_config
    from support_replay.train import train

    for i, spec in enumerate(LAYOUTS):
        os.environ["MASTER_PORT"] = str(ports[i])  # each run sets up and tears down its own process group
        cfg = run_config(
            checkpoint,
            Path(out) / str(i),
            num_rollout=2,
            global_batch_size=8,
            micro_batch_size=2,
            save=str(Path(out) / str(i) / "ckpt"),
            save_interval=2,
            tensor_model_parallel_size=spec.get("tp", 1),
            context_parallel_size=spec.get("cp", 1),
            context_parallel_layout=spec.get("cp_layout", "zigzag"),
        )
        rows = train(cfg)  # --ci-test on: rollout 1 was sampled with the weights gathered from this layout
        if rank == 0:
            results[i] = [(r["loss"], r["grad_norm"], r["train_rollout_logprob_abs_diff_max"]) for r in rows]


@pytest.mark.processes
def test_grpo_with_ci_test_in_each_layout(tiny_checkpoint, tmp_path):
    from recipe_helpers import run_config
    from support_replay.train import train

    ref = train(run_config(tiny_checkpoint, tmp_path / "one", num_rollout=2, global_batch_size=8, micro_batch_size=2))
    results = mp.Manager().dict()
    ports = [free_port() for _ in LAYOUTS]
    mp.spawn(_train_worker, args=(4, ports, str(tiny_checkpoint), str(tmp_path), results), nprocs=4, join=True)
    for i, spec in enumerate(LAYOUTS):
        for (loss, norm, diff), r in zip(results[i], ref):
            assert diff <= 1e-3, spec
            assert loss == pytest.approx(r["loss"], abs=1e-6) and norm == pytest.approx(r["grad_norm"], rel=1e-4), spec
    # a checkpoint saved by TP=2 x DP=2 resumes in one process: weights and optimizer state are saved whole
    resumed = train(
        run_config(
            tiny_checkpoint,
            tmp_path / "0",
            num_rollout=3,
            global_batch_size=8,
            micro_batch_size=2,
            save=str(tmp_path / "0" / "ckpt"),
            resume=True,
        )
    )
    assert resumed[-1]["rollout"] == 2 and resumed[-1]["train_rollout_logprob_abs_diff_max"] <= 1e-3
