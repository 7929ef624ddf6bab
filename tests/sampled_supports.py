"""Random logits and the supports our sampler realizes on them (the audit's core and findings tests), and the replay of
captured tokens against a reference model (the pausing and partial-rollout tests)."""

import torch

from support_replay.core.sampling import sample_tokens

VOCAB = 400


def random_logits(rows: int = 64, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def sampled(logits, params, semantics="sglang", seed=1):
    """``(sampled tokens, padded support ids, valid)`` of one draw."""
    out = sample_tokens(logits, params, semantics, generator=torch.Generator().manual_seed(seed))
    ids, valid = out.support.to_padded()
    return out, ids, valid


def replayed_diff(model, prompt_ids: list[int], output_ids: list[int], support, log_mu, start: int, end: int) -> float:
    """The largest |log pi - log mu| over outputs [start, end): ``model`` (an HF causal LM, temperature 1) scoring
    each output token on its captured support."""
    from support_replay import support_logprobs

    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0]
    first = len(prompt_ids) - 1
    scores = support_logprobs(logits[first : first + len(output_ids)], torch.tensor(output_ids), support, 1.0)
    return float((scores - torch.as_tensor(log_mu)).abs()[start:end].max())
