"""The engine's decode step at a batch x width, SmolLM2-135M-Instruct fp32 (docs/benchmarks.md, "Decode step:
the block pool against the slot rectangle").

``batch`` distinct random prompts of ``width - new`` tokens, ``new`` tokens each with EOS ignored;
the median engine step once every row is decoding (the admission's prefill and the last step left
out), over ``--repeats`` rollouts. Run it from two checkouts (``PYTHONPATH=<checkout>/src``) to
compare their engines in one sitting.

    python bench/decode_steps.py [--shapes 16x128,16x640] [--new 24] [--repeats 2] [--page-size 16]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from support_replay import SamplingParams
from support_replay import __file__ as package_file
from support_replay.engine import Engine, EngineSettings
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.protocol import GenerateRequest


def median_step(engine: Engine, batch: int, width: int, new: int, repeats: int, seed: int = 1) -> float:
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(repeats):
        prompts = [torch.randint(100, engine.vocab_size, (width - new,), generator=gen).tolist() for _ in range(batch)]
        reqs = [
            GenerateRequest(p, SamplingParams(top_k=50, seed=i), max_new_tokens=new, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        futures = engine.submit_all(reqs)
        engine.step()  # the admission's prefill and the first tokens
        steps = []
        while not all(f.done() for f in futures):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        times += steps[1:-1]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x128,16x640")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=None, help="the pool's block (engines that have one)")
    args = ap.parse_args()
    extra = {}
    if args.page_size is not None and "page_size" in inspect.signature(Engine.__init__).parameters:
        extra["page_size"] = args.page_size
    engine = Engine.from_pretrained(smollm2_checkpoint(), EngineSettings(**extra))
    print(f"engine from {package_file}")
    print("| batch x width | median decode step (ms) |")
    print("|---|---:|")
    for shape in args.shapes.split(","):
        batch, width = map(int, shape.split("x"))
        # prompts of their own per shape: one repeated from an earlier shape would hit the prefix cache
        ms = median_step(engine, batch, width, args.new, args.repeats, seed=batch * 100_003 + width) * 1e3
        print(f"| {batch} x {width:,} | {ms:.1f} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
