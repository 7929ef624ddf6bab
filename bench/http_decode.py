"""Decode over HTTP: ``support-replay serve`` against vLLM CPU's server on the same work.

    python bench/http_decode.py [--rounds 3] [--requests 16] [--tokens 64] [--skip-vllm]

16 concurrent requests of one chat prompt, 64 new tokens each, EOS ignored, temperature 1, top_k 32,
top_p 0.8, SmolLM2-135M-Instruct in fp32: ours through its SGLang-shaped ``/generate`` with the support
captured (``return_sampling_mask``), vLLM CPU 0.32 (its own venv, ``.venv-vllm``: ``make vllm``) through
``/v1/completions`` with token prompts. Each server runs alone on the machine while it is measured (the
other is not started), rounds alternate ours and vLLM, one warm-up request set first; tokens/s is
completion tokens over the wall time of the whole set, the table the median of the rounds.

vLLM is started as:

    VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model CHECKPOINT \\
        --served-model-name m --host 127.0.0.1 --port PORT --dtype float32 --max-model-len 512 \\
        --gpu-memory-utilization 0.2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from support_replay.launch import free_port, wait_healthy
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.kernel_probe import cpu_identity

ROOT = Path(__file__).parents[1]
PROMPT = "What is 12 plus 7? Think step by step."
SAMPLING = {"temperature": 1.0, "top_k": 32, "top_p": 0.8}


@contextmanager
def server(args: list[str], url: str, env: dict | None = None):
    log = Path(tempfile.mkdtemp()) / "server.log"
    # from the checkout's root: ``python -m`` puts the working directory on the path, and no module of bench/ may
    # stand in for a package the server imports
    proc = subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    try:
        wait_healthy(url, proc, 600, log)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ours(checkpoint: Path, port: int):
    args = [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", str(checkpoint)]
    return server(args + ["--port", str(port)], f"http://127.0.0.1:{port}")


def vllm(checkpoint: Path, port: int):
    python = ROOT / ".venv-vllm" / "bin" / "python"
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--served-model-name",
        "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
        "--gpu-memory-utilization", "0.2",
    ]  # fmt: skip
    return server(args, f"http://127.0.0.1:{port}", {"VLLM_SERVER_DEV_MODE": "1"})


def ours_request(client: httpx.Client, url: str, ids: list[int], tokens: int, seed: int) -> int:
    params = {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": seed, **SAMPLING}
    body = {"input_ids": ids, "sampling_params": params, "return_sampling_mask": True}
    out = client.post(url + "/generate", json=body)
    out.raise_for_status()
    return len(out.json()["output_ids"])


def vllm_request(client: httpx.Client, url: str, ids: list[int], tokens: int, seed: int) -> int:
    body = {"model": "m", "prompt": ids, "max_tokens": tokens, "ignore_eos": True, "seed": seed, **SAMPLING}
    out = client.post(url + "/v1/completions", json=body | {"return_token_ids": True})
    out.raise_for_status()
    return len(out.json()["choices"][0]["token_ids"])


def rate(request, url: str, ids: list[int], n: int, tokens: int, seed: int) -> float:
    """Completion tokens/s of ``n`` concurrent requests."""
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        done = list(pool.map(lambda i: request(client, url, ids, tokens, seed + i), range(n)))
        return sum(done) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    checkpoint = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    sides = {"support-replay serve, /generate, capture on": (ours, ours_request)}
    if not args.skip_vllm:
        sides["vLLM CPU 0.32, /v1/completions"] = (vllm, vllm_request)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, (start, request) in sides.items():
            port = free_port()
            with start(checkpoint, port):
                url = f"http://127.0.0.1:{port}"
                rate(request, url, ids, 2, 4, 10_000)  # warm-up
                rates[name].append(rate(request, url, ids, args.requests, args.tokens, 1000 * r))
            print(f"round {r}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    print(
        f"\nCPU: {cpu_identity()}; {args.requests} concurrent x {args.tokens} new tokens, EOS ignored, prompt "
        f"{len(ids)} tokens, {SAMPLING}, fp32, medians of {args.rounds} alternating rounds"
    )
    print("\n| server | tok/s | rounds |")
    print("|---|---:|---|")
    base = statistics.median(rates[next(iter(rates))])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} ({med / base:.2f}x ours) | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
