"""A LoRA run's weight push to a served engine: the merged weights against the adapter alone (--lora-sync).

SmolLM2-135M-Instruct with a rank-R adapter on every linear (B drawn nonzero, as after training), one
``support-replay serve`` engine behind our router (started as a run starts its engines). Each push is what
the trainer's sync does: stage the files, then the engine's routes (merged: /update_weights_from_disk;
adapter: /unload_lora_adapter, /load_lora_adapter, /update_weight_version, the engine merging it). Prints the
bytes staged and the median push time of --pushes pushes each, alternating, and checks the engine's answer to
one seeded request is the same bits after either push.

    python bench/lora_sync.py [--rank 16] [--pushes 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from support_replay.backends.sglang_weights import SGLangAdapterSync, SGLangSync
from support_replay.backends.weight_push import ADAPTER_NAME
from support_replay.launch import engines_behind_router, free_port
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.lora import LoraSettings, adapter_state, add_lora, merged_state

PROMPT = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "return_sampling_mask": True, "return_logprob": True}
SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.8, "top_k": 32, "seed": 7}


def states(rank: int):
    settings = LoraSettings(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules="all-linear")
    model = add_lora(AutoModelForCausalLM.from_pretrained(smollm2_checkpoint()), settings)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return settings, merged_state(state, settings.scaling), adapter_state(state)


def original(merged: dict) -> dict:
    """The checkpoint's own weights under the merged names (the base the engine starts from)."""
    from safetensors.torch import load_file

    saved = load_file(str(smollm2_checkpoint() / "model.safetensors"))
    return {k: saved[k] for k in merged if k in saved}


def answer(router: str, lora: bool) -> tuple:
    body = {**PROMPT, "sampling_params": SAMPLING, **({"lora_path": ADAPTER_NAME} if lora else {})}
    meta = httpx.post(router + "/generate", json=body, timeout=120).json()
    return tuple(meta["output_ids"]), str(meta["meta_info"]["output_token_logprobs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=5)
    args = ap.parse_args()
    settings, merged, adapter = states(args.rank)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        out = Path(tmp)
        port = free_port()
        serve = [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", str(smollm2_checkpoint())]
        serve += ["--port", str(port), "--weights-dir", str(out), "--deterministic"]
        _, router = engines_behind_router(stack, [serve], [port], out / "logs")
        full = SGLangSync(router, out / "merged")
        alone = SGLangAdapterSync(router, out / "adapter", settings)
        base = {**merged, **original(merged)}
        times = {"merged": [], "adapter": []}
        seen = {}
        for i in range(args.pushes):  # each push from the base weights, which are put back after it (untimed)
            start = time.perf_counter()
            alone.push(adapter, f"a{i}")
            times["adapter"].append(time.perf_counter() - start)
            seen["adapter"] = answer(router, lora=True)
            httpx.post(
                router + "/unload_lora_adapter", json={"lora_name": ADAPTER_NAME}, timeout=120
            ).raise_for_status()
            alone.loaded = None
            start = time.perf_counter()
            full.push(merged, f"m{i}")
            times["merged"].append(time.perf_counter() - start)
            seen["merged"] = answer(router, lora=False)
            full.push(base, "base")
        sizes = {
            "merged": (out / "merged" / "model.safetensors").stat().st_size,
            "adapter": sum(p.stat().st_size for p in (out / "adapter" / f"adapter-a{args.pushes - 1}").iterdir()),
        }
    print(f"\nSmolLM2-135M, rank {args.rank} on every linear, {args.pushes} pushes each, alternating")
    print("| push | bytes staged | median s | min s |")
    print("|---|---|---|---|")
    for mode in ("merged", "adapter"):
        t = times[mode]
        print(f"| {mode} | {sizes[mode]:,} | {statistics.median(t):.3f} | {min(t):.3f} |")
    print(f"same answer (ids and log-probs) after either push: {seen['merged'] == seen['adapter']}")


if __name__ == "__main__":
    main()
