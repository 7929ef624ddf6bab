"""Does score centering help here? The built-in task with a real mismatch, SC off and on, several seeds.

    python bench/score_centering.py [--seeds 0,1,2] [--rollouts 10] [--out runs/score-centering]
                                    [--plot docs/score_centering.png]
    python bench/score_centering.py --read runs/score-centering [--plot ...]   # tables from runs made
    python bench/score_centering.py --cost [--pairs 2]      # the update's time with SC off and on

Each run is `support-replay train` on its defaults (SmolLM2-135M-Instruct, the arithmetic task, 8
prompts x 4 samples at top_p 0.8 / top_k 32) with `--policy-loss reinforce --score-centering-weight
none` (the importance-free policy gradient against the sampler, the setting the centring corrects),
in a process of its own, for two mismatch kinds:

- `bf16`: the engine in bf16, the trainer in fp32 (`--rollout-dtype bfloat16`);
- `lag2`: asynchronous rollouts two versions behind at most (`--async-rollout --max-policy-lag 2`).

and score centering off and on (`--use-score-centering`). Prints per run the mean reward of the
first and the last quarter of the updates, the mean mismatch KL, the mean drift
(`score_centering_drift`) and the update's time; then the mean over seeds. Also: the bytes per
token of the sampler's log q of every support id on bench/support_stream.py's support sizes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from support_replay.core import wire  # noqa: E402
from support_stream import support_stream  # noqa: E402

KINDS = {"bf16": ["--rollout-dtype", "bfloat16"], "lag2": ["--async-rollout", "--max-policy-lag", "2"]}
ARMS = {"off": [], "on": ["--use-score-centering"]}
BASE = ["--policy-loss", "reinforce", "--score-centering-weight", "none"]


def run(out: Path, seed: int, kind: str, arm: str, rollouts: int) -> float:
    start = time.perf_counter()
    args = [sys.executable, "-m", "support_replay.cli", "train", "--seed", str(seed), "--output-dir", str(out)]
    args += ["--num-rollout", str(rollouts), "--no-progress", *BASE, *KINDS[kind], *ARMS[arm]]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(metrics: list[dict]) -> dict:
    reward = [r["reward_mean"] for r in metrics]
    quarter = max(1, len(reward) // 4)
    return {
        "first": float(np.mean(reward[:quarter])),
        "last": float(np.mean(reward[-quarter:])),
        "kl": float(np.mean([r.get("mismatch_kl", np.nan) for r in metrics])),
        "drift": float(np.mean([r.get("score_centering_drift", 0.0) for r in metrics])),
        "update_s": float(np.mean([r.get("time_update", np.nan) for r in metrics])),
        "reward": reward,
    }


def transport_table(tokens: int = 20000, vocab: int = 49152) -> None:
    table, selected = support_stream(tokens, vocab, seed=0)
    sizes = table.sizes()
    rng = np.random.default_rng(0)
    rows_logq = [np.log(rng.dirichlet(np.ones(n))).astype(np.float32) for n in sizes]
    support = len(wire.to_json(table, vocab, selected))
    logq = len(wire.floats_to_json(rows_logq))
    print(f"\nTransport on bench/support_stream.py's sizes ({tokens} tokens, mean |S| {sizes.mean():.2f}):")
    print("\n| what | bytes per token (base64) |")
    print("|---|---:|")
    print(f"| the support (binary wire form) | {support / tokens:.1f} |")
    print(f"| log q of every support id (float32, exact) | {logq / tokens:.1f} |")
    log_mu = json.dumps([float(r[0]) for r in rows_logq])
    print(f"| log mu alone (SGLang's float list, for comparison) | {len(log_mu) / tokens:.1f} |")


def cost(root: Path, pairs: int, rollouts: int = 4) -> None:
    """The update's time, SC off and on, alternated (``pairs`` times), same seed and settings (engine fp32)."""
    times = {"off": [], "on": []}
    for p in range(pairs):
        for arm in ("off", "on"):
            out = root / f"cost-{arm}-{p}"
            args = [sys.executable, "-m", "support_replay.cli", "train", "--seed", "0", "--output-dir", str(out)]
            args += ["--num-rollout", str(rollouts), "--no-progress", *BASE, *ARMS[arm]]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            times[arm] += [r["time_update"] for r in rows(out)][1:]  # the first update warms up
    off, on = np.mean(times["off"]), np.mean(times["on"])
    print(f"\n| SC | updates | mean update s |\n|---|---:|---:|\n| off | {len(times['off'])} | {off:.3f} |")
    print(f"| on | {len(times['on'])} | {on:.3f} |\n\nscore centering costs {on / off - 1:+.1%} of the update")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rollouts", type=int, default=10)
    ap.add_argument("--out", default="runs/score-centering")
    ap.add_argument("--read", default=None, help="only read the runs under this folder")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--cost", action="store_true", help="only time the update with SC off and on")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    if args.cost:
        cost(Path(args.out), args.pairs)
        return
    root = Path(args.read or args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    results, walls = {}, {}
    for kind in KINDS:
        for arm in ARMS:
            for seed in seeds:
                out = root / f"{kind}-{arm}-seed{seed}"
                if not args.read:
                    walls[kind, arm, seed] = run(out, seed, kind, arm, args.rollouts)
                results[kind, arm, seed] = summary(rows(out))
    print(f"SmolLM2-135M-Instruct, {args.rollouts} updates of 8 prompts x 4, reinforce with w = 1; seeds {seeds}")
    print("\n| mismatch | SC | seed | reward, first quarter | last quarter | mismatch KL | drift | update s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (kind, arm, seed), r in results.items():
        print(
            f"| {kind} | {arm} | {seed} | {r['first']:.3f} | {r['last']:.3f} | {r['kl']:.2e} | {r['drift']:.4f} | "
            f"{r['update_s']:.2f} |"
        )
    print("\n| mismatch | SC | mean reward, first quarter | last quarter | mismatch KL | drift | update s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        for arm in ARMS:
            group = [results[kind, arm, s] for s in seeds]
            mean = {k: float(np.mean([g[k] for g in group])) for k in ("first", "last", "kl", "drift", "update_s")}
            print(
                f"| {kind} | {arm} | {mean['first']:.3f} | {mean['last']:.3f} | {mean['kl']:.2e} | "
                f"{mean['drift']:.4f} | {mean['update_s']:.2f} |"
            )
    transport_table()
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(KINDS), figsize=(10, 3.5), sharey=True)
        for ax, kind in zip(axes, KINDS):
            for arm, style in (("off", "--"), ("on", "-")):
                curves = np.array([results[kind, arm, s]["reward"] for s in seeds])
                ax.plot(curves.mean(0), style, label=f"SC {arm} (mean of {len(seeds)} seeds)")
                ax.fill_between(range(curves.shape[1]), curves.min(0), curves.max(0), alpha=0.15)
            ax.set_title(f"mismatch: {kind}")
            ax.set_xlabel("update")
        axes[0].set_ylabel("mean reward")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
