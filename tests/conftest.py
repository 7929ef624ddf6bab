import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import build_tiny_checkpoint, build_tiny_moe_checkpoint  # noqa: E402


def pytest_sessionstart(session):
    """The project's CPU kernels (decode attention, the decode layer's elementwise work, the sampler's top-k
    selection) are built (once per machine and ISA, about a minute) here, before any test's server process would
    build them while its fixture waits for it to come up."""
    from support_replay.modeling.decode_attention import compiled

    compiled()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test whose true-on-policy engine or actor is refused because this CPU's kernels (at these ISA
    limits) offer no batch-invariant product skips, naming the CPU: the refusal itself is what the
    product promises there, and tests/modeling/test_invariant_products.py tests it by name."""
    from support_replay.errors import NoInvariantProduct

    try:
        return (yield)
    except NoInvariantProduct as exc:
        from support_replay.modeling.invariant_products import cpu_name

        pytest.skip(f"no batch-invariant product on this CPU ({cpu_name()}) with these kernels: {exc}")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Torch at 1 and at 2 threads (the machine's cores): bit-level facts are checked at both."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_agent_checkpoint(tmp_path_factory) -> Path:
    """The tiny model with room for multi-turn episodes and a tool system prompt (2,048 positions)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-agents"), max_positions=2048)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (8 experts, top-2) with the tiny tokenizer."""
    return build_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def tiny_mixtral_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Mixtral (8 experts, top-2) with the tiny tokenizer."""
    return build_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny-mixtral"), family="mixtral")


@pytest.fixture(scope="session")
def vllm_server(tiny_checkpoint, tmp_path_factory):
    """One real vLLM CPU server for the session (about a minute to start): processed log-probs,
    the token-in/token-out endpoint, and the dev-mode weight-reload routes. ``(url, checkpoint)``."""
    from processes import free_port, process, vllm_server_args
    from tiny_model import vllm_checkpoint
    from vllm_env import VLLM_PYTHON, vllm_missing

    if (why := vllm_missing()) is not None:
        pytest.skip(why)

    ckpt = vllm_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("vllm-llama"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = vllm_server_args(VLLM_PYTHON, ckpt, port)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        with process(args, url, timeout=300):
            yield url, ckpt
    finally:
        os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)


@pytest.fixture
def scored(monkeypatch):
    """Every (samples, trainer log pi) pair the recipe checked."""
    seen = []
    from support_replay.train import checks as checks_module

    original = checks_module.compare_with_rollout

    def keep(r, samples, logp, **kw):
        seen.append((samples, [x.clone() for x in logp]))
        return original(r, samples, logp, **kw)

    monkeypatch.setattr(checks_module, "compare_with_rollout", keep)
    return seen


@pytest.fixture
def unbuildable_kernels(monkeypatch, tmp_path):
    """``with unbuildable_kernels():`` the project's CPU kernels fail to build (a source that is not C++, an empty
    cache) and every cached build and check is forgotten, before and after, so the rest of the session builds
    them again as it did."""
    from support_replay.kernels import build, top_candidates
    from support_replay.modeling import decode_attention, decode_layer

    cached = (build.built, decode_attention.compiled, decode_layer.compiled, top_candidates.compiled)

    @contextmanager
    def failing():
        broken = tmp_path / "broken.cpp"
        broken.write_text("this is not C++\n")
        monkeypatch.setattr(build, "SOURCES", [broken])
        monkeypatch.setenv("SUPPORT_REPLAY_CACHE", str(tmp_path / "cache"))
        for function in cached:
            function.cache_clear()
        try:
            yield
        finally:
            for function in cached:
                function.cache_clear()

    return failing
