"""A tiny random Qwen3 checkpoint with a tokenizer trained offline: what engine tests run on
(or a Llama one with tied embeddings, SmolLM2's shape), and tiny mixtures of experts (Qwen3-MoE,
Mixtral, Qwen2-MoE, OLMoE) with the same tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 12 plus 7? The answer is 19.",
    "Compute 3 times 4. The answer is 12.",
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning with top-p sampling needs the realized support.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 20


def tiny_tokenizer(path: Path, vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained offline on ``CORPUS``, saved at ``path``."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def tiny_dims(tok, max_positions: int) -> dict:
    """The config fields every tiny test model shares (2 layers, hidden 64, 4 heads over 2 KV heads)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def build_tiny_checkpoint(
    path: Path,
    vocab_size: int = 384,
    seed: int = 0,
    max_positions: int = 512,
    chat_template: str = CHAT_TEMPLATE,
    llama_tied: bool = False,
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast = tiny_tokenizer(path, vocab_size, chat_template)
    torch.manual_seed(seed)
    config = (LlamaConfig if llama_tied else Qwen3Config)(
        **tiny_dims(fast, max_positions), head_dim=16, tie_word_embeddings=llama_tied
    )
    model = (LlamaForCausalLM if llama_tied else Qwen3ForCausalLM)(config)
    with torch.no_grad():  # a sharper distribution than the init, so supports vary in size
        model.lm_head.weight.mul_(25)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_moe_checkpoint(path: Path, family: str = "qwen3_moe", seed: int = 0, max_positions: int = 512) -> Path:
    """A tiny random MoE model (8 experts, top-2, 2 layers) with the tiny tokenizer; its routers are
    drawn wider than the init so tokens spread over the experts, and some choices are near ties."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(path)
    torch.manual_seed(seed)
    common = dict(tiny_dims(tok, max_positions), num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
        )
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=8))
    elif family == "qwen2_moe":  # with its shared expert and the gate on it, as Qwen2-MoE has them
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **common,
                num_experts=8,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                norm_topk_prob=False,
            )
        )
    elif family == "olmoe":
        model = OlmoeForCausalLM(
            OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8, norm_topk_prob=False)
        )
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.4)
    model.save_pretrained(path, safe_serialization=True)
    return path


def greedy_decode(runner, prompts, steps: int, reserve: list[int] | None = None) -> list[torch.Tensor]:
    """The logits of ``steps`` greedy decode steps after one prefill of ``prompts`` (``reserve``: each row's blocks
    taken at once, as the engine's admission takes them: rows at one pitch attend in place)."""
    batch, logits = runner.prefill(prompts, reserve=reserve)
    pos = torch.tensor([len(p) for p in prompts])
    seen = []
    for _ in range(steps):
        logits = runner.decode(batch, logits.argmax(-1), pos)
        pos += 1
        seen.append(logits)
    return seen


VLLM_DEFAULT_TOP_K = 5  # the vLLM model's generation_config.json sets it: vLLM's default for a request without top_k


def vllm_checkpoint(tiny_checkpoint: Path, path: Path) -> Path:
    """A Llama the CPU backend accepts (head_dim 64), with the tiny tokenizer. Its generation_config.json
    sets ``top_k``, which vLLM applies to a /v1/completions request that leaves top_k out: the trainer's
    clients, which send every setting, must be unaffected, and the audit must find it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    generation = path / "generation_config.json"
    values = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**values, "top_k": VLLM_DEFAULT_TOP_K}, indent=2))
    return path


def assert_answers_as_alone(engine, requests, together) -> None:
    """Each of ``together`` (answers to ``requests`` sent in one crowd) has the tokens, support and log mu,
    bit for bit, of its request sent alone to ``engine``."""
    import numpy as np

    for req, got in zip(requests, together):
        alone = engine.generate([req])[0]
        assert (
            got.output_ids == alone.output_ids
            and np.array_equal(got.log_mu, alone.log_mu)
            and got.support == alone.support
        )
