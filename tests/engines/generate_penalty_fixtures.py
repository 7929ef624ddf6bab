"""Penalty fixtures built by the engines' own code. Regenerate with ``make fixtures``.

Random cases (logits with ties and zeros, prompts, output histories with repeats, penalty
settings, logit biases) are drawn once from a seed; each engine's code turns them into
penalised logits:

- SGLang 0.5.23: the wheel's ``penaltylib`` (the frequency, presence and repetition
  penalizers and their orchestrator, unmodified) fed one output token per step as the
  scheduler does, then ``SamplingBatchInfo``'s ``update_penalties`` and the pre- and
  post-grammar transforms (cut out of ``sampling_batch_info.py`` and run as they stand); the
  logit bias tensor is built as ``SamplingBatchInfo.from_schedule_batch`` builds it.
- vLLM 0.32.0: ``vllm.v1.sample.ops.penalties.apply_all_penalties`` run in the vLLM
  environment (``.venv-vllm``), after the logit bias added at its ids as
  ``LogitBiasLogitsProcessor.apply`` does (vLLM applies that processor before the penalties,
  ``Sampler.apply_logits_processors``).

Outputs: ``fixtures/penalties-sglang-0.5.23.npz`` and ``fixtures/penalties-vllm-0.32.0.npz``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from sglang_code import _definitions, _module_from_file, source_dir  # noqa: E402

from vllm_env import VLLM_PYTHON, vllm_missing  # noqa: E402

VOCAB = 40
PENALTY_FILES = {
    "orchestrator": "sglang/srt/sampling/penaltylib/orchestrator.py",
    "frequency": "sglang/srt/sampling/penaltylib/frequency_penalty.py",
    "presence": "sglang/srt/sampling/penaltylib/presence_penalty.py",
    "repetition": "sglang/srt/sampling/penaltylib/repetition_penalty.py",
    "batch_info": "sglang/srt/sampling/sampling_batch_info.py",
}


def cases(n: int, seed: int = 0) -> dict:
    """``n`` cases as padded arrays: logits, prompt and output ids (-1 padding), penalties, bias."""
    rng = np.random.default_rng(seed)
    logits = np.where(
        rng.random((n, VOCAB)) < 0.5, np.round(rng.normal(0, 2, (n, VOCAB)) * 2) / 2, rng.normal(0, 3, (n, VOCAB))
    )
    logits[rng.random((n, VOCAB)) < 0.1] = 0.0  # zero logits: the sign rule of each engine matters there
    prompts, outputs = np.full((n, 12), -1), np.full((n, 24), -1)
    for i in range(n):
        hot = rng.integers(0, VOCAB, 8)  # a few ids repeat often
        p, o = rng.integers(0, 13), rng.integers(0, 25)
        prompts[i, :p] = rng.choice(hot, p) if rng.random() < 0.7 else rng.integers(0, VOCAB, p)
        outputs[i, :o] = rng.choice(hot, o) if rng.random() < 0.7 else rng.integers(0, VOCAB, o)
    pick = lambda values: np.asarray(values)[rng.integers(0, len(values), n)]  # noqa: E731
    bias = np.zeros((n, VOCAB), np.float32)
    has_bias = rng.random(n) < 0.4
    for i in np.flatnonzero(has_bias):
        ids = rng.choice(VOCAB, rng.integers(1, 4), replace=False)
        bias[i, ids] = rng.choice([-100.0, -2.5, 0.5, 3.0, 7.25], len(ids))
    return {
        "logits": logits.astype(np.float32),
        "prompts": prompts,
        "outputs": outputs,
        "frequency": pick([0.0, 0.0, 0.1, 0.5, 1.3, -0.4]).astype(np.float32),
        "presence": pick([0.0, 0.0, 0.2, 0.7, -0.3]).astype(np.float32),
        "repetition": pick([1.0, 1.0, 1.1, 1.5, 0.8, 2.0]).astype(np.float32),
        "bias": bias,
        "has_bias": has_bias,
    }


class _Batch:
    """What the orchestrator reads of a ScheduleBatch (it keeps a weak reference to it)."""

    def __init__(self, reqs, device):
        self.reqs, self.device = reqs, device


def sglang_penalised(c: dict) -> np.ndarray:
    """Every case through SGLang 0.5.23's penalizers and logit transforms."""
    root = source_dir_with_penalties()
    stubs = {
        n: types.ModuleType(n)
        for n in (
            "sglang",
            "sglang.srt",
            "sglang.srt.utils",
            "sglang.srt.utils.common",
            "sglang.srt.sampling",
            "sglang.srt.sampling.penaltylib",
        )
    }
    stubs["sglang.srt.utils.common"].is_pin_memory_available = lambda device=None: False
    stubs["sglang.srt.utils"].get_compiler_backend = lambda: "eager"
    stubs["sglang.srt.utils"].is_npu = lambda: True  # torch.compile(disable=True): the plain function, on CPU
    saved = {n: sys.modules.get(n) for n in stubs}
    sys.modules.update(stubs)
    try:
        orch = _module_from_file("sglang.srt.sampling.penaltylib.orchestrator", root / PENALTY_FILES["orchestrator"])
        freq = _module_from_file("sglang.srt.sampling.penaltylib.frequency_penalty", root / PENALTY_FILES["frequency"])
        pres = _module_from_file("sglang.srt.sampling.penaltylib.presence_penalty", root / PENALTY_FILES["presence"])
        rep = _module_from_file("sglang.srt.sampling.penaltylib.repetition_penalty", root / PENALTY_FILES["repetition"])
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    ns = {"torch": torch, "apply_scaling_penalties": rep.apply_scaling_penalties}
    _definitions(
        root / PENALTY_FILES["batch_info"],
        {
            "SamplingBatchInfo.update_penalties": None,
            "SamplingBatchInfo._apply_pre_grammar_logits_transforms": None,
            "SamplingBatchInfo._apply_post_grammar_logits_transforms": None,
        },
        ns,
    )
    out = np.zeros_like(c["logits"])
    for i in range(len(c["logits"])):
        params = SimpleNamespace(
            frequency_penalty=float(c["frequency"][i]),
            presence_penalty=float(c["presence"][i]),
            repetition_penalty=float(c["repetition"][i]),
        )
        batch = _Batch([SimpleNamespace(sampling_params=params)], "cpu")
        orchestrator = orch.BatchedPenalizerOrchestrator(
            VOCAB,
            batch,
            {freq.BatchedFrequencyPenalizer, pres.BatchedPresencePenalizer, rep.BatchedRepetitionPenalizer},
        )
        for token in c["outputs"][i][c["outputs"][i] >= 0]:  # one output token per decode step
            orchestrator.cumulate_output_tokens(torch.tensor([int(token)]))
        logit_bias = None
        if c["has_bias"][i]:  # as from_schedule_batch builds it: zeros, the request's ids set
            logit_bias = torch.zeros(1, VOCAB)
            ids = np.flatnonzero(c["bias"][i])
            logit_bias[torch.zeros(len(ids), dtype=torch.long), torch.tensor(ids)] = torch.tensor(c["bias"][i][ids])
        info = SimpleNamespace(
            penalizer_orchestrator=orchestrator, temperatures=torch.ones(1, 1), vocab_size=VOCAB, logit_bias=logit_bias
        )
        ns["update_penalties"](info)
        info.penalizer_orchestrator = None  # copy_for_forward: the forward sees the accumulated tensors only
        logits = torch.tensor(c["logits"][i : i + 1])
        ns["_apply_pre_grammar_logits_transforms"](info, logits)
        ns["_apply_post_grammar_logits_transforms"](info, logits)
        out[i] = logits[0].numpy()
    return out


def source_dir_with_penalties() -> Path:
    root = source_dir()
    if all((root / f).exists() for f in PENALTY_FILES.values()):
        return root
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "sglang==0.5.23", "-d", tmp],
            check=True,
            timeout=600,
        )
        with zipfile.ZipFile(next(Path(tmp).glob("sglang-*.whl"))) as wheel:
            for name in PENALTY_FILES.values():
                wheel.extract(name, root)
    return root


VLLM_SCRIPT = r"""
import sys, numpy as np, torch
from vllm.v1.sample.ops.penalties import apply_all_penalties
c = dict(np.load(sys.argv[1]))
V = c["logits"].shape[1]
out = np.zeros_like(c["logits"])
for i in range(len(out)):
    logits = torch.tensor(c["logits"][i : i + 1])
    if c["has_bias"][i]:  # LogitBiasLogitsProcessor.apply: logits[rows, cols] += bias, before the penalties
        ids = np.flatnonzero(c["bias"][i])
        logits[torch.zeros(len(ids), dtype=torch.long), torch.tensor(ids)] += torch.tensor(c["bias"][i][ids])
    prompt = c["prompts"][i][c["prompts"][i] >= 0]
    prompt_t = torch.tensor(prompt if len(prompt) else [V], dtype=torch.long)[None]  # padded with V, as vLLM pads
    output = [int(t) for t in c["outputs"][i] if t >= 0]
    if c["frequency"][i] or c["presence"][i] or c["repetition"][i] != 1:
        presence, frequency = torch.tensor([c["presence"][i]]), torch.tensor([c["frequency"][i]])
        repetition = torch.tensor([c["repetition"][i]])
        logits = apply_all_penalties(logits, prompt_t, presence, frequency, repetition, [output])
    out[i] = logits[0].numpy()
np.save(sys.argv[2], out)
"""


def vllm_penalised(c: dict, workdir: Path) -> np.ndarray:
    if (why := vllm_missing()) is not None:
        raise SystemExit(why)
    inputs, result, script = workdir / "cases.npz", workdir / "vllm.npy", workdir / "vllm_penalties.py"
    np.savez(inputs, **c)
    script.write_text(VLLM_SCRIPT)
    subprocess.run([str(VLLM_PYTHON), str(script), str(inputs), str(result)], check=True, timeout=600)
    return np.load(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1500)
    parser.add_argument("--engines", nargs="+", default=["sglang", "vllm"])
    args = parser.parse_args()
    out_dir = HERE / "fixtures"
    for k, name in enumerate(args.engines):
        c = cases(args.cases, seed=k)
        if name == "sglang":
            penalised, path = sglang_penalised(c), out_dir / "penalties-sglang-0.5.23.npz"
        else:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                penalised = vllm_penalised(c, Path(tmp))
            path = out_dir / "penalties-vllm-0.32.0.npz"
        np.savez_compressed(
            path, **c, penalised=penalised, source=np.array(json.dumps({"engine": name, "cases": args.cases}))
        )
        print(
            f"{path.name}: {args.cases} cases, {int((penalised != c['logits']).any(1).sum())} changed by the transforms"
        )


if __name__ == "__main__":
    main()
