"""Where a decode step's time goes, what its largest parts cost alone, what caches cost its sampling (benchmarks.md).

    python bench/decode_parts.py [--dtype float32|bfloat16] [--runs 3] [--skip-alone] [--decode-attention sdpa,kernel]
                                 [--layers compiled,pytorch]

1. **Parts**: ``bench/engine.py``'s GRPO work (4 chat prompts x 4 samples, 64 tokens, EOS ignored, capture on, each
   rollout after a weight update: the prefix cache emptied) on
   SmolLM2-135M-Instruct, with wall clocks around the engine's decode step and its parts inside it (the fused step,
   its products, its attention calls, its key/value writes; sampling with capture), per step, one column per run
   (``update_bound.Clocks``; the layer loop, which runs a step's layers in one compiled call, times its own parts:
   products, attention, the attention's inputs, the norms, SiLU x up). ``--decode-attention sdpa,kernel`` builds an
   engine per choice and alternates their runs (columns ``sdpa 1``, ``kernel 1``, ``sdpa 2``, ...); ``--layers
   loop,compiled,pytorch`` does the same for the layers: in one compiled call (engine/fused_step.py's layer loop), a
   Python loop over the compiled elementwise kernels (modeling/decode_layer.py, where the keys' and values' writes
   are part of the kernel that rotates the queries and keys, so they count in "the rest"), and PyTorch's operations.
2. **Attention alone**: ``F.scaled_dot_product_attention`` at a decode step's shapes (SmolLM2: 9 query heads on 3
   key-value heads, so 3 queries per key-value head as transformers' ``pack_gqa`` passes them; head size 64;
   width 112; an additive mask) for 1 and 16 rows, at 1 and at the run's threads; beside it the engine's decode
   kernel (modeling/decode_attention.py) on the same queries, keys and values, where it runs here.
3. **A step's products alone**: every linear layer of a step at 16 rows over 30 layers' distinct weights (so the
   weights stream from memory as in a step) and the head, on oneDNN's packed weights, MKL's ``F.linear`` and
   MKL's own packed GEMM (``torch.ops.mkl._mkl_linear``); medians of alternating rounds.
4. **The caches' share**: the sampler with capture (``sample_tokens``, the engine's selection) and the support's log
   mu alone (``support_logprobs``) on a step's 16 rows of logits, timed right after the same call (caches warm) and
   after a pass over the model's weights (every cache line of code and data the call touches evicted, as after a
   step's products): the difference is what the caches cost a step's sampling, not the work it does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine import PARAMS, resolve_model, shaped_rate
from support_replay import SamplingParams
from support_replay.core.logprobs import support_logprobs
from support_replay.core.sampling import sample_tokens
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.fused_step import LOOP_PARTS, FusedDecoder
from support_replay.engine.paged_cache import PagedCache
from support_replay.modeling.decode_attention import compiled
from support_replay.modeling.kernel_probe import cpu_identity
from update_bound import Clocks

PARTS = (
    ("decode", "the engine's decode step (model and sampling)"),
    ("fused", "the fused step"),
    ("products", "  of which the linear layers"),
    ("attention", "  of which attention"),
    ("writes", "  of which the keys' and values' writes (the Python loop)"),
    ("inputs", "  of which the queries' and keys' norms and rotation, the cache writes (the layer loop)"),
    ("norms", "  of which the residual adds and RMSNorms (the layer loop)"),
    ("silu", "  of which SiLU x up (the layer loop)"),
    ("sampling", "sampling and capture"),
)


def parts(engines: dict[str, Engine], runs: int) -> dict[str, dict[str, float]]:
    """Per-step milliseconds of each part, one dict per run of the GRPO work and engine, the engines alternating."""
    for engine in engines.values():
        if engine.runner.fused is None:
            raise SystemExit("this model decodes through its modules on this CPU: no fused step to take apart")
        shaped_rate(engine, 4, 4, 64, 1, share=True, seed_base=0)  # warm-up: packs, probes, first calls
    rows = {}
    for run in range(runs):
        for name, engine in engines.items():
            rows[f"{name} {run + 1}"] = one_run(engine, seed=10 + run)
    return rows


def one_run(engine: Engine, seed: int) -> dict[str, float]:
    """Per-step milliseconds of each part over one run of the GRPO work, and its tokens/s."""
    runner = engine.runner
    clocks = Clocks()  # a row per decode step: the parts timed inside it
    clocks.wrap(Engine, "_decode", "decode", opens=True)
    clocks.wrap(Engine, "_sample_and_advance", "sampling")
    clocks.wrap(FusedDecoder, "step", "fused")
    clocks.wrap(FusedDecoder, "_attend", "attention")
    clocks.wrap(PagedCache, "write", "writes")
    clocks.wrap(runner.fused, "linear", "products")  # the instance's products: plain and packed weights
    clocks.wrap(runner.fused, "packed_linear", "products")
    loop_times(clocks, runner.fused)
    try:
        rate = shaped_rate(engine, 4, 4, 64, 1, share=True, seed_base=seed, after_update=True)
    finally:
        clocks.close()
        runner.fused.time_loop = False
    n = max(len(clocks.rows), 1)
    row = {key: 1e3 * sum(step[key] for step in clocks.rows) / n for key, _ in PARTS}
    row["tok/s"], row["steps"] = rate, n
    return row


def loop_times(clocks: Clocks, fused: FusedDecoder) -> None:
    """The layer loop's parts, which it times itself inside its one call, into the step's row."""
    fused.time_loop = True
    real = fused._compiled_layers

    def timed_layers(*args):
        before = dict(fused.loop_seconds)
        try:
            return real(*args)
        finally:
            if clocks.rows:
                for key in LOOP_PARTS:
                    clocks.rows[-1][key] += fused.loop_seconds[key] - before[key]

    fused._compiled_layers = timed_layers
    clocks._restore.append((fused, "_compiled_layers", real))


def timed(fn, calls: int) -> float:
    """Microseconds per call of ``fn`` (after a warm-up)."""
    for _ in range(max(3, calls // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def attention_alone(dtype: torch.dtype) -> list[tuple[int, int, float, float | None]]:
    """(rows, threads, us per call of sdpa and of the decode kernel or None) at a decode step's shapes, width 112."""
    threads, out = torch.get_num_threads(), []
    gen = torch.Generator().manual_seed(0)
    built, _ = compiled()
    with torch.inference_mode():
        for rows in (1, 16):
            q = torch.randn(rows, 3, 3, 64, generator=gen).to(dtype)  # pack_gqa's [rows, kv heads, 3, 64]
            heads = q.reshape(rows, 9, 1, 64)  # the same queries as the kernel takes them
            k, v = (torch.randn(rows, 3, 112, 64, generator=gen).to(dtype) for _ in range(2))
            mask = torch.zeros(rows, 1, 1, 112, dtype=dtype)
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), 500)
                kernel = None if built is None else timed(lambda: built.decode_attention(heads, k, v, mask, 0.125), 500)
                out.append((rows, t, sdpa, kernel))
    torch.set_num_threads(threads)
    return out


def products_alone(rounds: int = 5) -> dict[str, float]:
    """Milliseconds of a SmolLM2 step's fp32 products at 16 rows over 30 layers' distinct weights and the head."""
    hidden, inter, vocab, layers, rows = 576, 1536, 49152, 30, 16
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(layers) for o, i in shapes]
    weights.append(torch.randn(vocab, hidden, generator=gen) * 0.02)
    xs = {i: torch.randn(rows, i, generator=gen) for i in (hidden, inter)}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    runs = {
        "oneDNN, packed weights": lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, onednn)
        ],
        "MKL, F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
    }
    if hasattr(torch.ops.mkl, "_mkl_linear"):
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        runs["MKL, packed GEMM"] = lambda: [
            torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows) for w, p in zip(weights, mkl)
        ]
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():
            fn()
        for _ in range(rounds):
            for name, fn in runs.items():  # alternating: the machine's drift falls on each
                start = time.perf_counter()
                fn()
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def sampling_caches(engine: Engine, calls: int = 30) -> list[tuple[str, float, float]]:
    """``(call, ms on warm caches, ms after a pass over the weights)``, medians over ``calls`` calls, of the sampler and
    of the log mu inside it on 16 rows of the head's logits (hidden states drawn at random)."""
    model = engine.runner.model
    weights = [p.detach() for p in model.parameters()]
    head = model.get_output_embeddings().weight.detach()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits = F.linear(torch.randn(16, head.shape[1], generator=generator, dtype=head.dtype), head).float()
    params = [SamplingParams(seed=i, **PARAMS) for i in range(16)]
    select, semantics = engine.sample.select, engine.sample.semantics

    def seeded():
        return [torch.Generator().manual_seed(i) for i in range(16)]

    def sample(generators):
        return sample_tokens(logits, params, semantics, generator=generators, capture=True, select=select)

    drawn = sample(seeded())
    ids, valid = drawn.support.to_padded()
    temperature = torch.full((16,), PARAMS["temperature"])

    def log_mu(_):
        return support_logprobs(logits, drawn.tokens, (ids, valid), temperature)

    rows = []
    for name, call in (("sample_tokens (selection, draw, capture)", sample), ("support_logprobs (log mu)", log_mu)):
        warm, cold = [], []
        for _ in range(calls):
            for flush, out in ((False, warm), (True, cold)):
                if flush:
                    for w in weights:  # every weight read once, as a step's products read them
                        w.sum()
                else:
                    call(seeded())  # the same call just before: its code and data in the caches
                generators = seeded()  # each call's own, made outside its time
                start = time.perf_counter()
                call(generators)
                out.append(1e3 * (time.perf_counter() - start))
        rows.append((name, statistics.median(warm), statistics.median(cold)))
    return rows


def layers_of(fused: FusedDecoder | None) -> str:
    if fused is None or not fused.compiled_layers:
        return "pytorch"
    return "loop (where a step's rows are in place)" if fused.layer_loop else "compiled"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-alone", action="store_true", help="only the parts of the engine's step")
    ap.add_argument(
        "--decode-attention", default="auto", help="the engines' --decode-attention, comma-separated: one engine each"
    )
    ap.add_argument(
        "--layers", default="loop", help="how the layers run, comma-separated: loop, compiled, pytorch (module doc)"
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    choices, layer_choices = args.decode_attention.split(","), args.layers.split(",")
    engines = {}
    for choice in choices:
        for layers in layer_choices:
            if layers not in ("loop", "compiled", "pytorch"):
                raise SystemExit(f"--layers: {layers!r} is not loop, compiled or pytorch")
            engine = Engine.from_pretrained(
                resolve_model("smollm2"), EngineSettings(decode_attention=choice), dtype=dtype
            )
            fused = engine.runner.fused
            if fused is not None:
                fused.compiled_layers = layers != "pytorch" and fused.layer_kernels is not None
                fused.layer_loop = fused.layer_loop and layers == "loop"
            names = [choice] * (len(choices) > 1) + [layers] * (len(layer_choices) > 1)
            engines["/".join(names) or choice] = engine
    engine = next(iter(engines.values()))
    print(
        f"SmolLM2-135M-Instruct {args.dtype}, kernel {engine.linear_kernel}, {torch.get_num_threads()} threads, "
        f"CPU: {cpu_identity()}; decode attention: "
        + ", ".join(f"{c} -> {e.decode_attention}" for c, e in engines.items())
        + "; layers: "
        + ", ".join(f"{c} -> {layers_of(e.runner.fused)}" for c, e in engines.items())
    )
    by_run = parts(engines, args.runs)
    caches = sampling_caches(engine) if not args.skip_alone else []
    for e in engines.values():
        e.shutdown()
    names, rows = list(by_run), list(by_run.values())
    print("\n| part of a decode step, GRPO shape (batch 16), ms per step | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(rows))
    for key, label in PARTS:
        print(f"| {label} | " + " | ".join(f"{r[key]:.2f}" for r in rows) + " |")
    timed = ("products", "attention", "writes", "inputs", "norms", "silu")
    rest = [r["fused"] - sum(r[key] for key in timed) for r in rows]
    outside = [r["decode"] - r["fused"] - r["sampling"] for r in rows]
    print(
        "|   the rest of the fused step (the layer loop: the embedding, rotary tables, masks, the call and views "
        "between the parts; the Python loop: its norms, rotary, adds, SiLU x up too) | "
        + " | ".join(f"{x:.2f}" for x in rest)
        + " |"
    )
    print(
        "| the rest of the decode step (the checks of the weights and packs, the batch's bookkeeping) | "
        + " | ".join(f"{x:.2f}" for x in outside)
        + " |"
    )
    print("| tokens/s of the run | " + " | ".join(f"{r['tok/s']:.1f}" for r in rows) + " |")
    if args.skip_alone:
        return
    print(
        f"\n| attention alone, {args.dtype}: rows x 3 key-value heads x 3 queries, width 112 | threads | "
        "sdpa us per call | decode kernel us per call |"
    )
    print("|---:|---:|---:|---:|")
    for rows_, threads, us, kernel in attention_alone(dtype):
        print(f"| {rows_} | {threads} | {us:.1f} | {'-' if kernel is None else f'{kernel:.1f}'} |")
    print("\n| a step's fp32 products alone, 16 rows, 30 layers' weights + head | ms, median of 5 alternating |")
    print("|---|---:|")
    for name, ms in products_alone().items():
        print(f"| {name} | {ms:.1f} |")
    print("\n| a step's sampling alone, 16 rows | ms, caches warm | ms after a pass over the weights |")
    print("|---|---:|---:|")
    for name, warm, cold in caches:
        print(f"| {name} | {warm:.2f} | {cold:.2f} |")


if __name__ == "__main__":
    main()
