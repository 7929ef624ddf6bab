"""Routing replay (R3) on a mixture of experts: faithfulness of the ratio, routing flips, transport cost.

    python bench/moe_replay.py [--prompts 16] [--samples 2] [--new-tokens 48] [--engine-dtype bfloat16]

The model: SmolLM2-135M-Instruct sparsely upcycled into a Mixtral-shaped MoE (4 experts, top-2; each
expert the dense MLP plus a 2% perturbation, a router drawn small so that experts are near-tied:
modeling/upcycle.py). No MoE weights can be downloaded here; the tests keep a random tiny MoE.

The engine samples prompts of the built-in arithmetic task at top_p 0.8 (top_k 1024), temperature 1,
capturing the support and the routing (``return_routed_experts``), in ``--engine-dtype``. The
trainer (fp32, the same weights) scores the same tokens three ways: the full vocabulary with its own
routing, the replayed support with its own routing, the replayed support with the engine's routing.

Tables: (1) mean pi/mu and the share of tokens outside [0.9, 1.1]; (2) routing flips (token-layer
choices where the trainer's own top-k set differs from the engine's) and |log pi - log mu| on the
tokens whose predicting position flipped in some layer against the others, without and with R3;
(3) what the routing costs on the wire per token (SGLang's raw int32 against vLLM's uint8 .npy,
ours), its encode + decode time, and its share of the step, for this model and for Qwen3-30B-A3B's
shape (48 layers, top-8 of 128 experts).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, full_logprobs, support_logprobs
from support_replay.core.routing import RoutingShape, decode_int32, decode_npy, encode_int32, encode_npy
from support_replay.core.wire import to_json
from support_replay.engine import Engine
from support_replay.modeling.checkpoints import smollm2_moe_checkpoint
from support_replay.modeling.moe import install_routing
from support_replay.protocol import GenerateRequest
from support_replay.rollout import ArithmeticTask
from support_replay.rollout.generate import render_prompt

QWEN3_30B_A3B = RoutingShape(layers=48, top_k=8, num_experts=128, moe_layers=tuple(range(48)))


def score(model, control, ids: list[int], prompt_len: int, routing: np.ndarray | None):
    """Response-position logits of one forward (own routing, or ``routing`` replayed) and its own routing."""
    control.record_next()
    replay = None if routing is None else torch.from_numpy(np.concatenate([routing, -np.ones_like(routing[:1])]))
    with torch.no_grad(), control.replaying(None if replay is None else replay.long()):
        logits = model(torch.tensor([ids])).logits[0, prompt_len - 1 : -1].float()
    return logits, control.stacked()[:-1].numpy()


def outside(r: np.ndarray) -> float:
    return float(np.mean((r < 0.9) | (r > 1.1)))


def transport_row(name: str, shape: RoutingShape, positions: int, step_s_per_token: float, support_bpt: float) -> str:
    rng = np.random.default_rng(0)
    routed = np.argsort(rng.random((positions, shape.layers, shape.num_experts)), -1)[..., : shape.top_k]
    routed = routed.astype(np.int32)
    cells = [name]
    for encode, decode in (
        (encode_int32, lambda v: decode_int32(v, shape.layers, shape.top_k, "r")),
        (lambda a: encode_npy(a, shape.num_experts), lambda v: decode_npy(v, "r")),
    ):
        t = time.perf_counter()
        text = encode(routed)
        assert np.array_equal(decode(text), routed)
        seconds = time.perf_counter() - t
        cells += [f"{len(text) / positions:.0f}", f"{seconds / positions * 1e6:.2f}"]
    cells.append(f"{float(cells[-1]) * 1e-6 / step_s_per_token:.3%}")
    cells.append(f"{float(cells[3]) / support_bpt:.1f}x" if support_bpt else "")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--engine-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument(
        "--noise", type=float, default=0.02, help="each expert's perturbation, relative to its weight's std"
    )
    ap.add_argument("--router-std", type=float, default=0.05, help="the router weights' standard deviation")
    args = ap.parse_args()
    path = smollm2_moe_checkpoint(noise=args.noise, router_std=args.router_std)
    engine = Engine.from_pretrained(path, dtype=getattr(torch, args.engine_dtype))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    control = install_routing(model)
    shape = control.shape
    task = ArithmeticTask(seed=0)
    prompts = [render_prompt(engine.tokenizer, task[i], True)[0] for i in range(args.prompts)]
    reqs = [
        GenerateRequest(
            ids,
            SamplingParams(temperature=1.0, top_p=0.8, top_k=1024, seed=k * args.samples + j),
            max_new_tokens=args.new_tokens,
            return_sampling_mask=True,
            return_routed_experts=True,
        )
        for k, ids in enumerate(prompts)
        for j in range(args.samples)
    ]
    start = time.perf_counter()
    completions = engine.generate(reqs)
    gen_s = time.perf_counter() - start
    tokens = sum(c.num_tokens for c in completions)
    ratios = {"full vocabulary, own routing": [], "support replay, own routing": [], "support + routing replay": []}
    flips = layer_choices = 0
    diff = {"own": ([], []), "r3": ([], [])}  # (flipped tokens, the others)
    support_bytes = 0
    for req, c in zip(reqs, completions):
        ids, p = req.input_ids + c.output_ids, len(req.input_ids)
        targets, mu = torch.tensor(c.output_ids), torch.from_numpy(c.log_mu)
        own_logits, own_routing = score(model, control, ids, p, None)
        r3_logits, _ = score(model, control, ids, p, c.routed_experts)
        full = full_logprobs(own_logits, targets, 1.0)
        own = support_logprobs(own_logits, targets, c.support, 1.0)
        r3 = support_logprobs(r3_logits, targets, c.support, 1.0)
        for name, lp in zip(ratios, (full, own, r3)):
            ratios[name].append(torch.exp(lp - mu).double().numpy())
        flipped = (np.sort(own_routing, -1) != np.sort(c.routed_experts, -1)).any(-1)  # [positions, layers]
        flips += int(flipped.sum())
        layer_choices += flipped.size
        # a response token is computed at its predicting position p - 1 + t; "flipped" if any layer flipped there
        token_flipped = flipped[p - 1 : p - 1 + c.num_tokens].any(-1)
        for key, lp in (("own", own), ("r3", r3)):
            d = (lp - mu).abs().numpy()
            diff[key][0].append(d[token_flipped])
            diff[key][1].append(d[~token_flipped])
        support_bytes += len(to_json(c.support, engine.vocab_size, c.output_ids))
    print(
        f"SmolLM2-135M-Instruct upcycled to a Mixtral-shaped MoE ({shape.num_experts} experts, top-{shape.top_k}, "
        f"{shape.layers} layers; experts perturbed by {args.noise:g}, router std {args.router_std:g}), "
        f"{len(reqs)} samples, {tokens} tokens; engine {args.engine_dtype}, trainer float32; "
        "top_p 0.8, top_k 1024, temperature 1"
    )
    print("\n| trainer's score | mean pi/mu | outside [0.9, 1.1] | max abs log-ratio |")
    print("|---|---:|---:|---:|")
    for name, r in ratios.items():
        r = np.concatenate(r)
        print(f"| {name} | {r.mean():.4f} | {outside(r):.2%} | {np.abs(np.log(r)).max():.3g} |")
    print(f"\nRouting flips (trainer's own top-k set != the engine's): {flips} of {layer_choices} token-layer choices "
          f"({flips / layer_choices:.3%})")  # fmt: skip
    print("\n| | tokens whose position flipped | mean abs(log pi - log mu) there | other tokens | mean there |")
    print("|---|---:|---:|---:|---:|")
    for key, label in (("own", "support replay, own routing"), ("r3", "support + routing replay")):
        hit, rest = np.concatenate(diff[key][0]), np.concatenate(diff[key][1])
        print(
            f"| {label} | {len(hit)} | {hit.mean() if len(hit) else float('nan'):.4g} | {len(rest)} | "
            f"{rest.mean():.4g} |"
        )
    step_per_token = gen_s / tokens
    support_bpt = support_bytes / tokens
    print(
        f"\nTransport (positions of 1024 tokens; the step: this run's generation, {step_per_token * 1e3:.1f} "
        f"ms/token; our binary support: {support_bpt:.1f} B/token)"
    )
    print(
        "\n| model shape | SGLang int32: B/token | encode+decode us/token | ours (.npy uint8): B/token | "
        "encode+decode us/token | share of the step | vs the support's bytes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(transport_row(f"this MoE ({shape.layers} x top-{shape.top_k})", shape, 1024, step_per_token, support_bpt))
    print(transport_row("Qwen3-30B-A3B (48 x top-8 of 128)", QWEN3_30B_A3B, 1024, step_per_token, support_bpt))


if __name__ == "__main__":
    main()
