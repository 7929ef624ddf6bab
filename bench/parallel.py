"""Memory and time of the actor's scoring step per rank as tensor / context parallelism grow.

    python bench/parallel.py [--layouts 1,tp3,cp2,cp4] [--tokens 256] [--samples 8]

SmolLM2-135M-Instruct (vocabulary 49,152; 9 heads, 3 key/value heads, so TP 1 or 3), fp32, one micro-batch of
``--samples`` sequences of
``--tokens`` response tokens (prompt 32), scored with full-vocabulary log-probs and entropy
with a gradient (what a KL loss or an entropy bonus asks for), forward and backward. Peak
memory is the resident set's rise over the step on each rank (sampled every millisecond; the
weights, loaded before, are not counted), the largest rank's reported. The vocab-parallel head
holds ``[T, V / tp]`` logits per rank; context parallelism splits ``T`` itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest resident set size seen while the block runs, above where it started."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def rise(self) -> int:
        return self.peak - self.start


def bench_samples(vocab: int, n: int, tokens: int, prompt: int = 32) -> list:
    """``n`` samples of random ids, each response token with a two-id support."""
    from support_replay import SupportTable
    from support_replay.rollout.sample import Sample

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        response = rng.integers(0, vocab, tokens).tolist()
        out.append(
            Sample(
                index=i,
                group=0,
                prompt_ids=rng.integers(0, vocab, prompt).tolist(),
                response_ids=response,
                loss_mask=np.ones(tokens, np.int8),
                support=SupportTable.from_lists([[t, (t + 1) % vocab] for t in response]),
                log_mu=np.zeros(tokens, np.float32),
            )
        )
    return out


def _worker(rank, world, port, spec, args, results):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from support_replay.core.losses import token_weights
    from support_replay.modeling.checkpoints import smollm2_checkpoint
    from support_replay.train.actor import Actor
    from support_replay.train.batches import plan_optimizer_steps
    from support_replay.train.dist import close_distributed, init_distributed
    from support_replay.train.layout import parallel_layout

    ctx = init_distributed()
    layout = parallel_layout(ctx, tp=spec.get("tp", 1), cp=spec.get("cp", 1))
    actor = Actor(
        smollm2_checkpoint(),
        ctx,
        lr=1e-6,
        betas=(0.9, 0.98),
        weight_decay=0.0,
        replay=True,
        full_with_grad=True,
        layout=layout,
    )
    samples = bench_samples(actor.vocab_size, args.samples, args.tokens)
    step = plan_optimizer_steps(
        samples, global_batch=len(samples), micro_batch=len(samples), rank=0, world=1, replay=True, device=ctx.device
    )[0]
    batch = step.micro_batches[0]

    def run():
        sc = actor.score(batch, 1.0, full=True, entropy=True)
        w = token_weights(
            batch.loss_mask, batch.lengths, "token", batch_tokens=step.tokens, batch_sequences=step.sequences
        )
        actor.backward(((sc.logp + 0.1 * sc.full - 0.01 * sc.entropy) * w).sum())
        actor.optimizer.zero_grad(set_to_none=True)

    run()  # warm-up: allocator and DTensor caches
    torch.distributed.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as peak:
        run()
    seconds = time.perf_counter() - t0
    results[rank] = (peak.rise, seconds)
    close_distributed(ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1,tp3,cp2,cp4", help="comma list: 1 (one process), tpN, cpN")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    from processes import free_port

    print(
        f"torch {torch.__version__}; SmolLM2-135M fp32, {args.samples} x ({32} prompt + {args.tokens} response) "
        "tokens, full-vocabulary scores with a gradient"
    )
    print("\n| layout | ranks | peak memory rise per rank (max) MiB | step s (forward + backward) |")
    print("|---|---:|---:|---:|")
    for name in args.layouts.split(","):
        spec = {} if name == "1" else {name[:2]: int(name[2:])}
        world = max(spec.values(), default=1)
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(world, free_port(), spec, args, results), nprocs=world, join=True)
        rise = max(r[0] for r in results.values())
        seconds = max(r[1] for r in results.values())
        print(f"| {name if spec else 'one process'} | {world} | {rise / 2**20:.0f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
