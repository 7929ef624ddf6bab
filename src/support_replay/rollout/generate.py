"""Single-turn rollouts through any backend: prompts in, Samples out.

The backend validated every completion where it entered this process; the Samples built
from them are trusted from here on.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..protocol import GenerateRequest
from ..sampling import SamplingParams
from .data import Prompt
from .sample import Sample


def render_prompt(tokenizer, prompt: Prompt, apply_chat_template: bool) -> tuple[list[int], str]:
    """Token ids and text of a prompt; chat messages always go through the chat template."""
    if isinstance(prompt.content, list) or apply_chat_template:
        messages = prompt.content if isinstance(prompt.content, list) else [{"role": "user", "content": prompt.content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"], text
    return tokenizer(prompt.content)["input_ids"], prompt.content


def validate_request(req: GenerateRequest, rollout_temperature: float, index: int) -> GenerateRequest:
    """A request that captures a support must sample at the run's rollout temperature: the
    trainer divides the actor's logits by that one value (docs/contract.md)."""
    if req.return_sampling_mask and req.params.temperature != rollout_temperature:
        raise ConfigError(
            f"request {index}: temperature {req.params.temperature} differs from the rollout temperature "
            f"{rollout_temperature} the trainer scores with (--rollout-temperature)"
        )
    return req


def request_seed(base: int, rollout: int, k: int) -> int:
    """A seed per (run, rollout, sample): the same rollout draws the same tokens after a resume."""
    return (base * 1_000_003 + rollout * 100_003 + k) % (2**62)


def generate_samples(
    backend,
    tokenizer,
    prompts: list[Prompt],
    *,
    params: SamplingParams,
    n_samples: int,
    max_new_tokens: int,
    capture: bool,
    reward_fn,
    rollout: int,
    seed: int,
    apply_chat_template: bool = False,
) -> list[Sample]:
    """``n_samples`` responses per prompt, grouped prompt by prompt, rewarded."""
    rendered = [render_prompt(tokenizer, p, apply_chat_template) for p in prompts]
    requests = []
    for g, (ids, _) in enumerate(rendered):
        for j in range(n_samples):
            k = g * n_samples + j
            sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=request_seed(seed, rollout, k))
            requests.append(validate_request(GenerateRequest(list(ids), sp, max_new_tokens=max_new_tokens, return_sampling_mask=capture), params.temperature, k))
    completions = backend.generate(requests)
    samples = []
    for k, (req, c) in enumerate(zip(requests, completions)):
        g = k // n_samples
        text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
        prompt_text = rendered[g][1]
        samples.append(
            Sample(
                index=k,
                group=g,
                prompt_ids=list(req.input_ids),
                response_ids=list(c.output_ids),
                loss_mask=np.ones(len(c.output_ids), np.int8),
                reward=float(reward_fn(prompt_text, text, prompts[g].label)),
                status="truncated" if c.finish_reason.get("type") == "length" else "completed",
                log_mu=c.log_mu,
                full_logprobs=c.full_logprobs,
                support=c.support,
                temperature=req.params.temperature,
                label=prompts[g].label,
                prompt_text=prompt_text,
                response_text=text,
                weight_versions=c.weight_versions,
                support_bytes=c.support_bytes,
            )
        )
    return samples
