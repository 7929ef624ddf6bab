"""GRPO steps on a GPU with a Qwen3-0.6B-shaped model: the check to run as it is wherever a GPU is lent.

    python bench/gpu_grpo.py [--steps 4] [--layers 28] [--launcher auto|ray|torchrun]

On a machine with CUDA (nothing downloaded, nothing installed: Python and torch as found there) it builds a
checkpoint from Qwen3-0.6B's config (hidden 1024, 28 layers, 16 query and 8 KV heads of 128, MLP 3072, vocabulary
151,936, tied embeddings; random bf16 weights) with a byte-level tokenizer trained here on a few sentences (384
tokens; the embedding rows past them are zero, so top-k 32 never samples one), then trains GRPO for ``--steps``
rollouts of 4 prompts x 4 samples, 128 tokens, top_p 0.8, top_k 32, with --ci-test: the trainer one FSDP2 rank in
bf16 with NCCL on the GPU, our engine in bf16 on the machine's CPU (it has no CUDA path). Ray places both
(``ray-run --colocate --ray-engine-device cpu``: one bundle, the rank's 0.4 GPU and the engine's 0.2) when Ray
imports, else ``local-run`` (torchrun, one rank; one ``serve --device cpu``); it says which. Printed: each step's
time, trained tokens per second, the GPU's peak memory in use (nvidia-smi, sampled every 0.5 s) and the largest
per-token |log pi - log mu|. Without CUDA it says so and exits 0; ``--allow-cpu`` runs the same path on a CPU (with
``--layers 2 --dtype float32 --max-len 16`` it checks the script here in a few minutes: a CPU without bf16
instructions runs bf16 8x slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

QWEN3_0_6B = dict(  # Qwen/Qwen3-0.6B's config.json, the fields that set the shape
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def build_checkpoint(path: Path, layers: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tiny_model import tiny_tokenizer

    tok = tiny_tokenizer(path)
    config = Qwen3Config(
        **QWEN3_0_6B, num_hidden_layers=layers, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[len(tok) :] = 0  # tied: those ids score 0, below the top 32 of the rest
    model.save_pretrained(path, safe_serialization=True)
    return path


def gpu_memory_peak(stop: threading.Event, out: list) -> None:
    """The largest memory.used nvidia-smi reports over the run, MiB (every GPU of the machine)."""
    while not stop.is_set():
        try:
            used = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.split()
            out.append(sum(int(x) for x in used))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop.wait(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--launcher", choices=("auto", "ray", "torchrun"), default="auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--allow-cpu", action="store_true", help="run on a CPU anyway (a check of this script)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("bench/gpu_grpo.py: no CUDA on this machine: nothing to check (run it where a GPU is)")
        return 0
    try:
        import ray  # noqa: F401

        has_ray = True
    except ImportError:
        has_ray = False
    launcher = args.launcher if args.launcher != "auto" else ("ray" if has_ray else "torchrun")
    work = Path(tempfile.mkdtemp())
    began = time.monotonic()
    checkpoint = build_checkpoint(work / "qwen3-0.6b-shaped", args.layers)
    built = time.monotonic() - began
    out = work / "run"
    train = [
        *("--hf-checkpoint", str(checkpoint), "--num-rollout", str(args.steps), "--rollout-batch-size", "4"),
        *("--n-samples-per-prompt", "4", "--global-batch-size", "16", "--rollout-max-response-len", str(args.max_len)),
        *("--rollout-top-p", "0.8", "--rollout-top-k", "32", "--ci-test", "--no-progress", "--output-dir", str(out)),
        *("--train-dtype", args.dtype, "--rollout-dtype", args.dtype),
    ]
    cli = [sys.executable, "-m", "support_replay.cli"]
    if launcher == "ray":
        command = [*cli, "ray-run", "--ray-engine-device", "cpu", "--", *train, "--colocate"]
        command += ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus-per-engine", "1"]
    else:
        command = [*cli, "local-run", "--engines", "1", "--nproc-per-node", "1", "--serve-arg=--device=cpu", "--"]
        command += train
    device = torch.cuda.get_device_name(0) if cuda else "no GPU (--allow-cpu)"
    print(
        f"bench/gpu_grpo.py: {device}; torch {torch.__version__}; Python {sys.version.split()[0]}; launcher "
        f"{launcher} ({'Ray ' + __import__('ray').__version__ if launcher == 'ray' else 'torchrun'}); checkpoint of "
        f"{args.layers} layers built in {built:.1f} s",
        flush=True,
    )
    stop, samples = threading.Event(), []
    watcher = threading.Thread(target=gpu_memory_peak, args=(stop, samples), daemon=True)
    if shutil.which("nvidia-smi"):
        watcher.start()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "tests")}
    done = subprocess.run(command, env=env, timeout=540)
    stop.set()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if out.exists() else []
    print("| step | time s | trained tokens | tokens/s | max |log pi - log mu| |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        tokens = r["samples"] * r["response_len_mean"]
        print(
            f"| {r['rollout']} | {r['time_step']:.2f} | {tokens:.0f} | {tokens / r['time_step']:.0f} | "
            f"{r['train_rollout_logprob_abs_diff_max']:.2e} |"
        )
    peak = f"{max(samples)} MiB" if samples else "not read (no nvidia-smi)"
    print(
        f"peak GPU memory in use: {peak}; --ci-test: {'passed' if done.returncode == 0 else 'FAILED'} "
        f"(exit {done.returncode}); {len(rows)} of {args.steps} steps",
        flush=True,
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
