"""The audit's per-token parts and filter evidence (core) against float64 references and the sampler itself."""

import math

import pytest
import torch

from sampled_supports import VOCAB, random_logits
from sampled_supports import sampled as draw
from support_replay.core.mismatch_parts import filter_evidence, fit_temperature, ratio_parts, temperature_residual
from support_replay.core.sampling import SamplingParams


def test_ratio_parts_match_a_float64_dense_reference():
    logits = random_logits()
    out, ids, valid = draw(logits, SamplingParams(temperature=0.9, top_k=16, top_p=0.8))

    def transform(z, ids):  # a penalty-like transform of the support logits
        return z - 0.5 * (ids % 3 == 0)

    parts = ratio_parts(logits, out.tokens, ids, valid, 0.9, transform)
    z = logits.double() / 0.9
    full = torch.log_softmax(z, -1).gather(1, out.tokens[:, None]).squeeze(1)
    mask = torch.zeros(z.shape, dtype=torch.int32).scatter_add_(1, ids, valid.int()) > 0  # padding repeats ids
    masked = torch.log_softmax(z.masked_fill(~mask, -math.inf), -1).gather(1, out.tokens[:, None]).squeeze(1)
    pen = logits.double() - 0.5 * (torch.arange(VOCAB) % 3 == 0)
    pen = torch.log_softmax((pen / 0.9).masked_fill(~mask, -math.inf), -1).gather(1, out.tokens[:, None]).squeeze(1)
    assert torch.allclose(parts["full"].double(), full, atol=1e-5)
    assert torch.allclose(parts["support"].double(), masked, atol=1e-5)
    assert torch.allclose(parts["penalised"].double(), pen, atol=1e-5)
    assert bool((ids.gather(1, parts["column"][:, None]).squeeze(1) == out.tokens).all())
    # the truncation part is log Z_S: the log of the kept mass, never positive
    assert bool((parts["full"] - parts["support"] <= 1e-6).all())


@pytest.mark.parametrize("semantics", ["sglang", "vllm"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=16, top_p=0.8), SamplingParams(top_k=40, min_p=0.05), SamplingParams(top_k=8)],
    ids=["top-p", "min-p", "top-k"],
)
def test_supports_sampled_with_the_declared_settings_are_what_the_evidence_expects(semantics, params):
    logits = random_logits()
    _, ids, valid = draw(logits, params, semantics)
    ev = filter_evidence(logits, ids, valid, params, semantics)
    assert bool((ev["observed"] == ev["expected"]).all()) and bool((ev["common"] == ev["observed"]).all())
    assert bool((ev["kept_rank"] == ev["observed"] - 1).all())  # every support is a prefix of the ranking
    assert not bool(ev["first_out_expected"].any())
    if params.top_p < 1:
        assert float(ev["kept_mass"].max()) <= params.top_p + 1e-6
    if params.min_p > 0:
        assert float(ev["kept_ratio"].min()) >= params.min_p - 1e-6


def test_the_fitted_temperature_is_the_one_that_sampled():
    logits = random_logits(scale=2.0)
    out, ids, valid = draw(logits, SamplingParams(temperature=0.7, top_k=32, top_p=0.95))
    z = logits.gather(1, ids)
    column = ((ids == out.tokens[:, None]) & valid).to(torch.uint8).argmax(-1)
    assert abs(fit_temperature(z, valid, column, out.log_mu) - 0.7) < 1e-3
    assert float(temperature_residual(z, valid, column, out.log_mu, 0.7).abs().max()) < 1e-5
    assert float(temperature_residual(z, valid, column, out.log_mu, 1.0).abs().mean()) > 1e-2
