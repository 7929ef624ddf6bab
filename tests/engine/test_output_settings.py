"""vLLM's and SGLang's output settings in the engine: min_tokens masks EOS and the stop tokens before
the filters (outside the captured support, so a fresh forward scored on that support gives log mu),
ignore_eos, and the text with or without the matched stop token or string and special tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay import SamplingParams, support_logprobs
from support_replay.core.penalties import Penalties
from support_replay.engine import Engine, EngineSettings
from support_replay.errors import RequestError
from support_replay.protocol import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(seed=0)).start()
    yield eng
    eng.shutdown()


def eos_favoured(engine, **kw) -> GenerateRequest:
    """A request whose logit bias makes EOS all but certain at every step."""
    eos = engine.tokenizer.eos_token_id
    bias = Penalties.with_bias(0.0, 0.0, 1.0, {str(eos): 30.0})
    params = SamplingParams(temperature=1.0, top_k=8, seed=kw.pop("seed", 1))
    ids = engine.tokenizer("The quick brown fox")["input_ids"]
    return GenerateRequest(ids, params, max_new_tokens=kw.pop("max_new_tokens", 8), penalties=bias, **kw)


def test_min_tokens_masks_eos_outside_the_support_and_replay_stays_exact(engine, tiny_checkpoint):
    eos = engine.tokenizer.eos_token_id
    (short,) = engine.generate([eos_favoured(engine, return_sampling_mask=True)])
    assert short.output_ids == [eos] and short.finish_reason == {"type": "stop", "matched": eos}
    req = eos_favoured(engine, min_new_tokens=4, return_sampling_mask=True)
    (c,) = engine.generate([req])
    assert len(c.output_ids) == 5 and c.output_ids[-1] == eos and eos not in c.output_ids[:4]
    assert all(eos not in row for row in c.support.to_lists()[:4]) and eos in c.support.to_lists()[4]
    # the trainer's score on the captured support, from a fresh forward with the same bias, is log mu
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([req.input_ids + c.output_ids])).logits[0].float()
    rows = logits[len(req.input_ids) - 1 : len(req.input_ids) - 1 + len(c.output_ids)].clone()
    rows[:, eos] += 30.0
    again = support_logprobs(rows, torch.tensor(c.output_ids), c.support, 1.0)
    torch.testing.assert_close(again, torch.tensor(c.log_mu), atol=1e-4, rtol=0)
    (ignored,) = engine.generate([eos_favoured(engine, ignore_eos=True)])
    assert len(ignored.output_ids) == 8 and ignored.finish_reason["type"] == "length"
    with pytest.raises(RequestError, match=r"min_new_tokens: must be an integer in \[0, max_new_tokens=8\], got 9"):
        eos_favoured(engine, min_new_tokens=9)


def test_the_text_leaves_out_the_matched_stop_unless_asked(engine):
    base = GenerateRequest(
        engine.tokenizer("Numbers: 0 1 2 3")["input_ids"], SamplingParams(temperature=0.0), max_new_tokens=10
    )
    (greedy,) = engine.generate([base])
    stop = greedy.output_ids[2]
    first = greedy.output_ids.index(stop)

    def text(**kw):
        (c,) = engine.generate([GenerateRequest(base.input_ids, base.params, max_new_tokens=10, **kw)])
        return c

    plain = text(stop_token_ids=[stop])
    kept = text(stop_token_ids=[stop], include_stop_str_in_output=True)
    assert plain.output_ids == kept.output_ids == greedy.output_ids[: first + 1]
    assert plain.text == engine.tokenizer.decode(greedy.output_ids[:first])
    assert kept.text == engine.tokenizer.decode(greedy.output_ids[: first + 1])
    whole = engine.tokenizer.decode(greedy.output_ids)
    stop_str = whole[len(whole) // 2 : len(whole) // 2 + 2]
    cut = text(stop=[stop_str])
    with_it = text(stop=[stop_str], include_stop_str_in_output=True)
    assert with_it.text == cut.text + stop_str and stop_str not in cut.text
    late = text(stop=[stop_str], min_new_tokens=10)  # no stop string ends the first min_tokens tokens
    assert late.finish_reason["type"] == "length" and len(late.output_ids) == 10
    eos = engine.tokenizer.eos_token_id
    (special,) = engine.generate(
        [eos_favoured(engine, include_stop_str_in_output=True, skip_special_tokens=False, max_new_tokens=2)]
    )
    assert special.output_ids == [eos] and special.text == engine.tokenizer.eos_token
