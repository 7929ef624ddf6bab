"""Random logits and the supports our sampler realizes on them, for the audit's core and findings tests."""

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
