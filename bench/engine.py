"""Decode throughput of the embedded engine, capture on vs off, and against HF generate.

    python bench/engine.py [--model smollm2|tiny|PATH] [--new-tokens 64] [--dtype bfloat16]
    python bench/engine.py --deterministic-compare [--batches 1,8,32]
    python bench/engine.py --kernel-compare [--repeats 3]
    python bench/engine.py --against-hf --repeats 3 [--dtype bfloat16]

For batch 1, 8 and 32: completion tokens/s with the support captured for every token and
without (evaluation requests). Then 16 concurrent requests of 64 new tokens against
Hugging Face ``generate`` with the same sampling (temperature 1, top_k 32, top_p 0.8): once
with EOS ignored on both sides (pure decode), once stopping at EOS, counting real
completion tokens (``generate`` keeps stepping finished rows until the longest is done;
the engine retires them). Then requests shaped like a GRPO rollout (4 prompts x 4 samples; against ``generate``
each rollout comes after a weight update, as a GRPO loop's does: the prefix cache emptied)
and 16 distinct prompts, with each prompt prefilled per request and with identical prompts
prefilled once (the engine's default). Then both shapes against ``generate`` (left-padded prompts,
``num_return_sequences``) in the engine's dtype, with the share of ``generate``'s time spent in
the linear layers and the bound that sets: no engine on the same weights can take less time
than its own linear layers, so ``generate``'s time over our linear-layer time bounds the ratio.
``--deterministic-compare``: the normal and the batch-invariant engine side by side.
``--kernel-compare``: the engine on each linear kernel (``torch``: MKL for fp32, ``onednn``), with
its fused decode step and through the model's modules, on the GRPO shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.protocol import GenerateRequest

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
        text = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
        )
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(PROMPT)["input_ids"]


def engine_rate(
    engine: Engine, ids, batch: int, new_tokens: int, capture: bool, repeats: int, ignore_eos: bool = True
) -> float:
    reqs = [
        GenerateRequest(
            ids,
            SamplingParams(seed=i, **PARAMS),
            max_new_tokens=new_tokens,
            ignore_eos=ignore_eos,
            return_sampling_mask=capture,
        )
        for i in range(batch)
    ]
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        results = engine.generate(reqs)
        rate = sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)
        best = max(best, rate)
    return best


def timed_rate(engine: Engine, ids, batch: int, new_tokens: int, capture: bool) -> tuple[float, float, float]:
    """``(tokens/s, seconds outside the model's forward, seconds in all)`` of one run."""
    runner, inside = engine.runner, [0.0]
    forward = {name: getattr(runner, name) for name in ("decode", "prefill")}

    def clocked(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - start

        return call

    for name, fn in forward.items():
        setattr(runner, name, clocked(fn))
    try:
        start = time.perf_counter()
        rate = engine_rate(engine, ids, batch, new_tokens, capture, 1)
        elapsed = time.perf_counter() - start
    finally:
        for name in forward:
            delattr(runner, name)  # the class's methods again
    return rate, elapsed - inside[0], elapsed


QUESTIONS = [
    "What is 12 plus 7?",
    "Compute 3 times 4.",
    "What is 40 minus 13?",
    "What is 6 times 9?",
    "Add 25 and 17.",
    "What is 81 divided by 9?",
    "Compute 14 plus 29.",
    "What is 7 times 8?",
    "Subtract 19 from 50.",
    "What is 11 times 11?",
    "Add 33 and 48.",
    "What is 90 minus 37?",
    "Compute 5 times 13.",
    "What is 64 divided by 8?",
    "Add 120 and 45.",
    "What is 9 times 12?",
]


def shaped_rate(
    engine: Engine,
    prompts: int,
    per_prompt: int,
    new_tokens: int,
    repeats: int,
    share: bool,
    seed_base: int = 0,
    after_update: bool = False,
) -> float:
    """Completion tokens/s of ``prompts`` distinct chat prompts x ``per_prompt`` samples, EOS ignored;
    ``share`` off prefills every request's prompt on its own row (as before prefix sharing). ``after_update``: each
    rollout as a GRPO loop's, after a weight update, which empties the prefix cache (timed with the rollout: the
    engine clears it before the first admission). Without it the last rollouts' rows stay cached and each rollout
    writes blocks past them, memory never written before (on this project's VMs ~3 ms a fresh MB, some 10% of a
    GRPO-shape rollout of SmolLM2, until the pool has been written through once: docs/benchmarks.md)."""
    ids = shaped_prompts(engine.tokenizer, prompts)
    runner = engine.runner
    runner.share_prompts = share
    try:
        best = 0.0
        for r in range(repeats):
            reqs = [
                GenerateRequest(
                    p,
                    SamplingParams(seed=seed_base + 1000 * r + 10 * g + j, **PARAMS),
                    max_new_tokens=new_tokens,
                    ignore_eos=True,
                    return_sampling_mask=True,
                )
                for g, p in enumerate(ids)
                for j in range(per_prompt)
            ]
            start = time.perf_counter()
            if after_update:
                engine.flush_prefix_cache()
            out = engine.generate(reqs)
            best = max(best, sum(len(c.output_ids) for c in out) / (time.perf_counter() - start))
        return best
    finally:
        runner.share_prompts = True


def prefill_ms(engine: Engine, prompts: int, per_prompt: int, repeats: int) -> tuple[float, float]:
    """Median milliseconds of one prefill of the shaped batch: each request on its own row, and
    identical prompts once (interleaved, so the machine's drift hits both alike)."""
    batch = [p for p in shaped_prompts(engine.tokenizer, prompts) for _ in range(per_prompt)]
    alone, shared = [], []
    for _ in range(repeats):
        for share, out in ((False, alone), (True, shared)):
            engine.runner.share_prompts = share
            start = time.perf_counter()
            engine.runner.prefill(batch)
            out.append(1e3 * (time.perf_counter() - start))
    engine.runner.share_prompts = True
    return float(np.median(alone)), float(np.median(shared))


class LinearClock:
    """Wall time spent inside the ``nn.Linear`` layers of a model (forward pre/post hooks), and in
    the products of the engine's fused decode step when ``runner`` has one (its layer loop, one compiled call for
    a step's layers, times its own products: ``loop_seconds``)."""

    def __init__(self, model, runner=None):
        self.seconds, self._start = 0.0, 0.0
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self._hooks = [
            h for m in linears for h in (m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post))
        ]
        self._fused = runner.fused if runner is not None and runner.use_fused else None
        self._restore = {}
        if self._fused is not None:
            for name in ("linear", "packed_linear"):  # the plain and the packed-weight products
                self._restore[name] = getattr(self._fused, name)
                setattr(self._fused, name, self._timed(self._restore[name]))
            self._fused.time_loop = True
            self._loop_start = self._fused.loop_seconds["products"]

    def _timed(self, product):
        def timed(*args):
            start = time.perf_counter()
            out = product(*args)
            self.seconds += time.perf_counter() - start
            return out

        return timed

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        for name, product in self._restore.items():
            setattr(self._fused, name, product)
        if self._fused is not None:
            self.seconds += self._fused.loop_seconds["products"] - self._loop_start
            self._fused.time_loop = False


def shaped_prompts(tokenizer, prompts: int) -> list[list[int]]:
    return [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS[:prompts]
    ]


def hf_shaped(model, tokenizer, prompts: int, per_prompt: int, new_tokens: int, seed: int) -> tuple[float, float]:
    """One ``generate`` on ``prompts`` distinct chat prompts (left-padded) x ``per_prompt`` return sequences,
    EOS ignored: ``(tokens/s, seconds in the linear layers)``."""
    ids = shaped_prompts(tokenizer, prompts)
    width = max(map(len, ids))
    inputs = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    torch.manual_seed(seed)
    clock = LinearClock(model)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=inputs,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=per_prompt,
            pad_token_id=tokenizer.pad_token_id or 0,
            **PARAMS,
        )
    elapsed = time.perf_counter() - start
    clock.close()
    return prompts * per_prompt * new_tokens / elapsed, clock.seconds


def ours_shaped(engine: Engine, prompts: int, per_prompt: int, new_tokens: int, seed: int) -> tuple[float, float]:
    """The engine on the same work, capture on, one run: ``(tokens/s, seconds in the linear layers)``."""
    clock = LinearClock(engine.runner.model, engine.runner)
    rate = shaped_rate(engine, prompts, per_prompt, new_tokens, 1, share=True, seed_base=1000 * seed, after_update=True)
    clock.close()
    return rate, clock.seconds


def shaped_against_hf(engine: Engine, model, shapes, new_tokens: int, rounds: int) -> None:
    """Each shape, ``generate`` and the engine alternating for ``rounds`` rounds (the machine's drift falls on
    both); every column a median over the rounds. The bound: no engine on our linear layers' products can take
    less time than those products, so ``generate``'s time over our linear-layer time bounds the ratio;
    ratio / bound is then our linear layers' share of our own time."""
    print(
        f"\n| {engine.runner.model.dtype}, 16 requests x {new_tokens} tokens, EOS ignored, medians of {rounds} "
        "alternating rounds | HF generate tok/s | HF time in linear layers | ours tok/s | ratio | bound from our "
        "linear layers | ratio / bound (our linear share) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, prompts, per in shapes:
        work = prompts * per * new_tokens
        rows = []
        for r in range(rounds):
            hf, hf_linear = hf_shaped(model, engine.tokenizer, prompts, per, new_tokens, r)
            ours, ours_linear = ours_shaped(engine, prompts, per, new_tokens, r)
            bound = (work / hf) / ours_linear
            rows.append((hf, hf_linear * hf / work, ours, ours / hf, bound, ours / hf / bound))
        med = [float(np.median([row[i] for row in rows])) for i in range(6)]
        print(
            f"| {name} | {med[0]:.1f} | {100 * med[1]:.0f}% | {med[2]:.1f} | **{med[3]:.2f}x** | {med[4]:.2f}x | "
            f"{med[5]:.3f} |"
        )
        print(f"<!-- rounds: {', '.join(f'{row[3]:.2f}x / {row[5]:.3f}' for row in rows)} -->")


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
                input_ids=inputs,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id or 0,
                **PARAMS,
                **extra,
            )
        elapsed = time.perf_counter() - start
        real = 0
        for row in out[:, inputs.shape[1] :].tolist():
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if not ignore_eos else len(row)
            real += stop
        best = max(best, real / elapsed)
    return best


def compare_deterministic(path: Path, args) -> None:
    """Tokens/s of the normal and the deterministic (batch-invariant) engine, capture on, in paired
    rounds (one run of each, back to back) so the machine's drift hits both alike; the ratio is
    the median of the rounds' ratios."""
    engines = {
        mode: Engine.from_pretrained(
            path, EngineSettings(deterministic=mode, linear_kernel=args.linear_kernel), dtype=getattr(torch, args.dtype)
        )
        for mode in (False, True)
    }
    ids = prompt_ids(engines[False])
    for e in engines.values():
        engine_rate(e, ids, 2, 4, True, 1)  # warm-up
    print(
        f"model={args.model} dtype={args.dtype} linear kernel={engines[True].linear_kernel} prompt={len(ids)} tokens, "
        f"new={args.new_tokens}, "
        f"threads={torch.get_num_threads()}, {args.repeats} paired rounds"
    )
    print("\n| batch | normal tok/s (best) | deterministic tok/s (best) | deterministic / normal (median of rounds) |")
    print("|---:|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        rounds = [
            (
                engine_rate(engines[False], ids, b, args.new_tokens, True, 1),
                engine_rate(engines[True], ids, b, args.new_tokens, True, 1),
            )
            for _ in range(args.repeats)
        ]
        normal, exact = max(r[0] for r in rounds), max(r[1] for r in rounds)
        print(f"| {b} | {normal:.1f} | {exact:.1f} | {statistics.median(d / n for n, d in rounds):.2f}x |")
    for e in engines.values():
        e.shutdown()


def compare_kernels(path: Path, args) -> None:
    """GRPO-shaped tokens/s of the engine with each linear kernel, through the module tree and the
    fused decode step (oneDNN's: on plain and on packed weights), rounds interleaved (median of the
    rounds) so the machine's drift hits every variant alike."""
    kernels = ["torch", "onednn"] if args.dtype == "float32" else ["torch"]
    engines = {
        k: Engine.from_pretrained(
            path, EngineSettings(linear_kernel=k, deterministic=args.deterministic), dtype=getattr(torch, args.dtype)
        )
        for k in kernels
    }
    variants = [
        (k, step)
        for k in kernels
        for step in ("module tree", "fused") + (("fused, packed weights",) if k == "onednn" else ())
    ]
    rates: dict = {v: [] for v in variants}
    for e in engines.values():
        shaped_rate(e, 4, 4, 4, 1, share=True)  # warm-up
    for r in range(args.repeats):
        for kernel, step in variants:
            runner = engines[kernel].runner
            runner.use_fused = step != "module tree" and runner.fused is not None
            if runner.fused is not None:
                runner.fused.packing = step == "fused, packed weights"
            rates[(kernel, step)].append(
                shaped_rate(
                    engines[kernel], 4, 4, args.new_tokens, 1, share=True, seed_base=1000 * r, after_update=True
                )
            )
            runner.use_fused = runner.fused is not None
    print(
        f"model={args.model} dtype={args.dtype} deterministic={args.deterministic} GRPO shape 4 x 4 x "
        f"{args.new_tokens} tokens, EOS ignored, "
        f"capture on, threads={torch.get_num_threads()}, median of {args.repeats} interleaved rounds"
    )
    print("\n| linear kernel | decode step | tok/s | vs torch, module tree |")
    print("|---|---|---:|---:|")
    base = float(np.median(rates[("torch", "module tree")]))
    for kernel, step in variants:
        rate = float(np.median(rates[(kernel, step)]))
        print(f"| {kernel} | {step} | {rate:.1f} | {rate / base:.2f}x |")
    for e in engines.values():
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny, or a checkpoint directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="engine weights and activations"
    )
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant forward (true-on-policy mode)")
    ap.add_argument(
        "--deterministic-compare", action="store_true", help="normal and deterministic engines, capture on, one sitting"
    )
    ap.add_argument(
        "--linear-kernel", choices=["auto", "torch", "onednn"], default="auto", help="the engine's linear-layer product"
    )
    ap.add_argument(
        "--decode-attention",
        choices=["auto", "kernel", "sdpa"],
        default="auto",
        help="the engine's one-token attention (modeling/decode_attention.py)",
    )
    ap.add_argument(
        "--kernel-compare",
        action="store_true",
        help="the engine on each linear kernel and on the module-tree decode, GRPO shape",
    )
    ap.add_argument(
        "--against-hf",
        action="store_true",
        help="only the GRPO-shaped and distinct-prompt runs against HF generate, --repeats alternating rounds",
    )
    args = ap.parse_args()

    path = resolve_model(args.model)
    if args.deterministic_compare:
        compare_deterministic(path, args)
        return
    if args.kernel_compare:
        compare_kernels(path, args)
        return
    engine = Engine.from_pretrained(
        path,
        EngineSettings(
            deterministic=args.deterministic, linear_kernel=args.linear_kernel, decode_attention=args.decode_attention
        ),
        dtype=getattr(torch, args.dtype),
    )
    ids = prompt_ids(engine)
    engine_rate(engine, ids, 2, 4, True, 1)  # warm-up
    print(
        f"model={args.model} dtype={args.dtype} deterministic={args.deterministic} linear "
        f"kernel={engine.linear_kernel} decode attention={engine.decode_attention} prompt={len(ids)} tokens, "
        f"new={args.new_tokens}, "
        f"threads={torch.get_num_threads()}, sampling={PARAMS}, CPU: {cpu_identity()}"
    )
    shapes = [("GRPO shape: 4 prompts x 4 samples", 4, 4), ("16 distinct prompts", 16, 1)]
    if args.against_hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        shaped_against_hf(engine, model, shapes, args.new_tokens, args.repeats)
        engine.shutdown()
        return
    print(
        f"\n| batch | capture off tok/s | capture on tok/s | end-to-end cost (median of {args.repeats} paired rounds) "
        "| "
        "time outside the forward, on - off, share of the run |"
    )
    print("|---:|---:|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        # off and on alternate, so the machine's drift hits both alike; each round's pair gives one cost.
        # The end-to-end figure carries the machine's noise (several %); the time spent outside the
        # model's forward (sampling, capture, bookkeeping) is what capturing adds, measured directly
        pairs = [
            (timed_rate(engine, ids, b, args.new_tokens, False), timed_rate(engine, ids, b, args.new_tokens, True))
            for _ in range(args.repeats)
        ]
        off, on = (float(np.median([p[i][0] for p in pairs])) for i in (0, 1))
        cost = float(np.median([100 * (o[0] - c[0]) / o[0] for o, c in pairs]))
        extra = float(np.median([100 * (c[1] - o[1]) / c[2] for o, c in pairs]))
        print(f"| {b} | {off:.1f} | {on:.1f} | {cost:+.1f}% | {extra:+.1f}% |")
    print(
        f"\n| 16 requests x {args.new_tokens} tokens, capture on | prefill per request tok/s | shared prefill tok/s | "
        "gain |"
    )
    print("|---|---:|---:|---:|")
    for name, prompts, per in shapes:
        alone = shaped_rate(engine, prompts, per, args.new_tokens, args.repeats, share=False)
        shared = shaped_rate(engine, prompts, per, args.new_tokens, args.repeats, share=True)
        print(f"| {name} | {alone:.1f} | {shared:.1f} | {shared / alone:.2f}x |")
    print("\n| prefill of the 16 requests alone (median of 15, interleaved) | per request ms | shared ms | gain |")
    print("|---|---:|---:|---:|")
    for name, prompts, per in shapes:
        alone, shared = prefill_ms(engine, prompts, per, 15)
        print(f"| {name} | {alone:.1f} | {shared:.1f} | {alone / shared:.2f}x |")
    if not args.skip_hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        shaped_against_hf(engine, model, shapes, args.new_tokens, args.repeats)
        ours = engine_rate(engine, ids, 16, args.new_tokens, True, args.repeats)
        ours_eos = engine_rate(engine, ids, 16, args.new_tokens, True, args.repeats, ignore_eos=False)
        engine.shutdown()
        model = model.float()  # against fp32 generate, whatever the engine's dtype
        hf = hf_rate(model, engine.tokenizer, ids, 16, args.new_tokens, args.repeats)
        hf_eos = hf_rate(model, engine.tokenizer, ids, 16, args.new_tokens, args.repeats, ignore_eos=False)
        print(f"\n| 16 concurrent x {args.new_tokens} new tokens | EOS ignored: tok/s | stop at EOS: real tok/s |")
        print("|---|---:|---:|")
        print(f"| Hugging Face generate (batch 16) | {hf:.1f} | {hf_eos:.1f} |")
        print(
            f"| support-replay engine, capture on | {ours:.1f} ({ours / hf:.2f}x) | {ours_eos:.1f} "
            f"({ours_eos / hf_eos:.2f}x) |"
        )
    else:
        engine.shutdown()


if __name__ == "__main__":
    main()
