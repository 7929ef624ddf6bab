"""The deterministic forward: a sequence's logits are the same bits in the engine (left-padded
batches, KV cache, prefill then decode) and in the trainer (one right-padded forward)."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest
from support_replay.engine.model_runner import ModelRunner


def test_engine_and_trainer_logits_are_bitwise_equal(tiny_checkpoint):
    model = make_batch_invariant(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval())
    runner = ModelRunner(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    batch, logits = runner.prefill(prompts)
    steps, seqs = [logits], [list(p) for p in prompts]
    nxt, pos = logits.argmax(-1), torch.tensor([len(p) for p in prompts])
    for _ in range(5):
        for s, x in zip(seqs, nxt.tolist()):
            s.append(x)
        logits = runner.decode(batch, nxt, pos)
        pos += 1
        steps.append(logits)
        nxt = logits.argmax(-1)
    order = [2, 0, 1]  # another batch, another order, right padding
    width = max(len(s) for s in seqs)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for r, k in enumerate(order):
        ids[r, : len(seqs[k])] = torch.tensor(seqs[k])
        mask[r, : len(seqs[k])] = 1
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.float()
    for t, step in enumerate(steps):
        for k in range(3):
            assert torch.equal(full[order.index(k), len(prompts[k]) - 1 + t], step[k]), (t, k)


def test_deterministic_engine_output_does_not_depend_on_the_batch(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=True).start()
    try:
        req = GenerateRequest([5, 6, 7], SamplingParams(top_k=20, top_p=0.9, seed=3), max_new_tokens=8, return_sampling_mask=True)
        alone = engine.generate([req])[0]
        others = [GenerateRequest([9, 9, 9, 9, 9, 9][: 2 + i], SamplingParams(top_k=10, seed=i), max_new_tokens=5 + i) for i in range(3)]
        crowded = engine.generate(others[:2] + [req] + others[2:])[2]
        assert alone.output_ids == crowded.output_ids and np.array_equal(alone.log_mu, crowded.log_mu) and alone.support == crowded.support
        model = engine.runner.model
        with torch.no_grad():
            logits = model(torch.tensor([req.input_ids + alone.output_ids])).logits[0, 2:-1].float()
        again = support_logprobs(logits, torch.tensor(alone.output_ids), alone.support, 1.0)
        assert torch.equal(again, torch.from_numpy(alone.log_mu))  # bit for bit
    finally:
        engine.shutdown()


def test_a_grpo_group_is_prefilled_once_and_answers_as_if_alone(tiny_checkpoint, monkeypatch):
    """4 prompts x 4 samples: one prefill row per distinct prompt; with the deterministic forward
    every request's tokens, supports and log mu equal the same request sent alone."""
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=True)
    rows = []
    original = engine.runner._prefill
    monkeypatch.setattr(engine.runner, "_prefill", lambda prompts: rows.append(len(prompts)) or original(prompts))
    engine.start()
    try:
        prompts = [[5, 6, 7], [11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34]]
        reqs = [GenerateRequest(p, SamplingParams(top_k=20, top_p=0.9, seed=10 * g + j), max_new_tokens=6, return_sampling_mask=True)
                for g, p in enumerate(prompts) for j in range(4)]
        together = engine.generate(reqs)
        assert rows == [4]  # 16 requests admitted at once, 4 prompts prefilled
        for req, got in zip(reqs, together):
            alone = engine.generate([req])[0]
            assert got.output_ids == alone.output_ids and np.array_equal(got.log_mu, alone.log_mu) and got.support == alone.support
        assert len({tuple(c.output_ids) for c in together}) > 4  # the group members sampled apart
    finally:
        engine.shutdown()
