"""A few hundred fuzzed inputs per target (bench/fuzz.py runs the full counts): only our errors, no
5xx, no hang (tests/fuzzing.py says what each target promises)."""

import pytest

from fuzzing import fuzz_http, fuzz_sglang, fuzz_vllm, fuzz_wire
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.limits import EngineLimits
from support_replay.serving.server import create_app


def test_fuzzed_wire_streams_raise_only_wire_errors_or_round_trip():
    seen = fuzz_wire(400)
    assert seen.get("rejected", 0) > 100 and sum(v for k, v in seen.items() if k != "peak_bytes_max") == 400


def test_fuzzed_sglang_payloads_raise_only_our_errors():
    assert sum(fuzz_sglang(300).values()) == 300


def test_fuzzed_vllm_payloads_raise_only_our_errors():
    assert sum(fuzz_vllm(300).values()) == 300


@pytest.mark.slow
def test_schema_driven_requests_get_no_5xx(tiny_checkpoint):
    engine = Engine.from_pretrained(
        tiny_checkpoint, EngineSettings(limits=EngineLimits(max_new_tokens=4, max_prompt_tokens=64))
    ).start()
    seen = fuzz_http(create_app(engine), 40)
    engine.shutdown()
    assert (
        len({op for op, _ in seen["answers"]}) == 19
    )  # every operation of the schema was tried (/v1/completions, /inference/v1/generate, the weights in a body, the
    # LoRA adapter routes, pause, continue and abort_request, and a teacher's /score_support too)
    assert all(status < 500 for _, status in seen["answers"])
