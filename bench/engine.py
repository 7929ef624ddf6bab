"""Decode throughput of the embedded engine, capture on vs off, and against HF generate.

    python bench/engine.py [--model smollm2|tiny|PATH] [--new-tokens 64]

For batch 1, 8 and 32: completion tokens/s with the support captured for every token and
without (evaluation requests). Then 16 concurrent requests of 64 new tokens against
Hugging Face ``generate`` with the same sampling (temperature 1, top_k 32, top_p 0.8): once
with EOS ignored on both sides (pure decode), once stopping at EOS, counting real
completion tokens (``generate`` keeps stepping finished rows until the longest is done;
the engine retires them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest
from support_replay.modeling.checkpoints import smollm2_checkpoint

PARAMS = dict(temperature=1.0, top_k=32, top_p=0.8)
PROMPT = "What is 12 plus 7? Think step by step."


def resolve_model(name: str) -> Path:
    if name == "smollm2":
        return smollm2_checkpoint()
    if name == "tiny":
        sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
        from tiny_model import build_tiny_checkpoint

        return build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    return Path(name)


def prompt_ids(engine: Engine) -> list[int]:
    tok = engine.tokenizer
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(PROMPT)["input_ids"]


def engine_rate(engine: Engine, ids, batch: int, new_tokens: int, capture: bool, repeats: int, ignore_eos: bool = True) -> float:
    reqs = [
        GenerateRequest(ids, SamplingParams(seed=i, **PARAMS), max_new_tokens=new_tokens, ignore_eos=ignore_eos, return_sampling_mask=capture)
        for i in range(batch)
    ]
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        results = engine.generate(reqs)
        rate = sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)
        best = max(best, rate)
    return best


def hf_rate(model, tokenizer, ids, batch: int, new_tokens: int, repeats: int, ignore_eos: bool = True) -> float:
    """Real completion tokens/s of ``generate``: tokens up to and including EOS, no padding after it."""
    inputs = torch.tensor([ids] * batch)
    mask = torch.ones_like(inputs)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    extra = {"min_new_tokens": new_tokens} if ignore_eos else {}
    best = 0.0
    for seed in range(repeats):
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=inputs, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id or 0, **PARAMS, **extra,
            )
        elapsed = time.perf_counter() - start
        real = 0
        for row in out[:, inputs.shape[1] :].tolist():
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if not ignore_eos else len(row)
            real += stop
        best = max(best, real / elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny, or a checkpoint directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="engine weights and activations")
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant forward (true-on-policy mode)")
    args = ap.parse_args()

    path = resolve_model(args.model)
    engine = Engine.from_pretrained(path, dtype=getattr(torch, args.dtype), deterministic=args.deterministic).start()
    ids = prompt_ids(engine)
    engine_rate(engine, ids, 2, 4, True, 1)  # warm-up
    print(f"model={args.model} dtype={args.dtype} deterministic={args.deterministic} prompt={len(ids)} tokens, new={args.new_tokens}, threads={torch.get_num_threads()}, sampling={PARAMS}")
    print("\n| batch | capture off tok/s | capture on tok/s | capture cost |")
    print("|---:|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        off = engine_rate(engine, ids, b, args.new_tokens, False, args.repeats)
        on = engine_rate(engine, ids, b, args.new_tokens, True, args.repeats)
        print(f"| {b} | {off:.1f} | {on:.1f} | {100 * (off - on) / off:+.1f}% |")
    if not args.skip_hf:
        ours = engine_rate(engine, ids, 16, args.new_tokens, True, args.repeats)
        ours_eos = engine_rate(engine, ids, 16, args.new_tokens, True, args.repeats, ignore_eos=False)
        engine.shutdown()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf = hf_rate(model, engine.tokenizer, ids, 16, args.new_tokens, args.repeats)
        hf_eos = hf_rate(model, engine.tokenizer, ids, 16, args.new_tokens, args.repeats, ignore_eos=False)
        print(f"\n| 16 concurrent x {args.new_tokens} new tokens | EOS ignored: tok/s | stop at EOS: real tok/s |")
        print("|---|---:|---:|")
        print(f"| Hugging Face generate (batch 16) | {hf:.1f} | {hf_eos:.1f} |")
        print(f"| support-replay engine, capture on | {ours:.1f} ({ours / hf:.2f}x) | {ours_eos:.1f} ({ours_eos / hf_eos:.2f}x) |")
    else:
        engine.shutdown()


if __name__ == "__main__":
    main()
