import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import ci_skips  # noqa: E402
import spawns  # noqa: E402
from tiny_model import build_tiny_checkpoint, build_tiny_moe_checkpoint  # noqa: E402


def pytest_configure(config):
    config.pluginmanager.register(spawns, "spawns")  # the `processes` marker, kept true (tests/spawns.py)
    config.pluginmanager.register(ci_skips, "ci-skips")  # under CI=true a skip fails (tests/ci_skips.py)
    config.pluginmanager.register(GroupsTookEffect(), "groups-took-effect")


def pytest_sessionstart(session):
    """On an xdist worker, torch takes one thread (two workers share two cores; the processes a test starts keep
    their default, so a server and the test comparing with it run at different thread counts).

    The project's CPU kernels (decode attention, the decode layer's elementwise work, the sampler's top-k
    selection, the invariant arithmetic) are built (once per machine and ISA, about a minute) here, before any
    test's server process would build them while its fixture waits for it to come up."""
    from support_replay.modeling.decode_attention import compiled

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    compiled()


# Session fixtures that start real engines: under xdist every test using one runs on the same worker, so that each
# engine starts once per run (as without xdist), not once per worker.
SHARED_ENGINES = {"sglang_servers": "sglang", "vllm_server": "vllm"}


def _weight(item) -> int:
    """A rough cost, to hand the workers the costly groups first: a test that starts processes, a slow one, the rest."""
    if item.get_closest_marker(spawns.MARKER) or spawns.PROCESS_FIXTURES & set(item.fixturenames):
        return 20
    return 3 if item.get_closest_marker("slow") else 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under xdist (``--dist loadgroup``) a file's tests stay on one worker (its module fixtures are built once),
    and the tests of a shared engine on one worker whatever their file. The groups are ordered costliest first
    (with --no-loadscope-reorder xdist hands them out in this order), so that no long group starts last while
    the other worker has nothing left to do."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups: dict[str, list] = {}
    for item in items:
        shared = [group for fixture, group in SHARED_ENGINES.items() if fixture in item.fixturenames]
        group = shared[0] if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    costliest = sorted(groups.values(), key=lambda members: -sum(map(_weight, members)))
    items[:] = [item for members in costliest for item in members]


class GroupsTookEffect:
    """On an xdist worker under ``--dist loadgroup``, xdist has written each item's group into its node id (where the
    scheduler reads it) by the time this runs. If it did not (a pytest whose node ids ignore the write), the run
    stops: it would start every shared engine once per worker and each file's module fixtures once per test."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if getattr(config.option, "loadgroup", False) and items and "@" not in items[0].nodeid:
            raise pytest.UsageError(
                f"--dist loadgroup did not take effect (pytest {pytest.__version__}): the node id {items[0].nodeid!r}"
                " carries no group; pyproject.toml pins a pytest that pytest-xdist groups with (pytest-xdist#1386)"
            )


def pytest_sessionfinish(session):
    """An xdist worker hands the engines it ran to the controller, for its summary."""
    if hasattr(session.config, "workeroutput"):
        from exercised import RAN

        session.config.workeroutput["ran"] = dict(RAN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from exercised import RAN

    RAN.update(getattr(node, "workeroutput", {}).get("ran", {}))


def pytest_terminal_summary(terminalreporter):
    """What the run exercised: the CPU, the ISA ATen took and the caps set, the kernels built, the product each mode
    ran, and the real engines' versions."""
    from exercised import exercised_lines

    terminalreporter.section("exercised")
    for line in exercised_lines():
        terminalreporter.write_line(line)


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
def tiny_qwen2_moe_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2-MoE (8 experts, top-2, a shared expert) with the tiny tokenizer."""
    return build_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-moe"), family="qwen2_moe")


@pytest.fixture(scope="session")
def tiny_olmoe_checkpoint(tmp_path_factory) -> Path:
    """A tiny random OLMoE (8 experts, top-2) with the tiny tokenizer."""
    return build_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny-olmoe"), family="olmoe")


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
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its model worker in the engine core's process: 11 s sooner
    try:
        with process(args, url, timeout=300):
            import httpx

            from exercised import ran

            ran("vLLM (its server, real)", httpx.get(url + "/version", timeout=30).json().get("version", "?"))
            yield url, ckpt
    finally:
        os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


@pytest.fixture(scope="session")
def sglang_servers(tiny_checkpoint):
    """Two real SGLang 0.5.23 servers for the session, on its CPU path, started side by side (about 20 s, 2 GB
    each): its own HTTP server, scheduler, ``Qwen3ForCausalLM`` and PyTorch sampler, on the tiny checkpoint. The
    second is for smg in front of two. Each a ``SGLangServer`` (url, checkpoint, its log)."""
    import time
    from contextlib import ExitStack

    import httpx

    from exercised import ran
    from processes import free_port, terminate_group, wait_healthy
    from sglang_env import SGLangServer, sglang_missing, sglang_process

    if (why := sglang_missing()) is not None:
        pytest.skip(why)
    start = time.monotonic()
    with ExitStack() as stack:
        servers = [sglang_process(tiny_checkpoint, free_port(), health=False) for _ in range(2)]
        procs = [stack.enter_context(server) for server, _ in servers]
        stack.callback(lambda: [terminate_group(proc) for proc in procs])  # runs first: both stop side by side
        for proc, (_, url) in zip(procs, servers):
            wait_healthy(url, proc, timeout=300, log=proc.log)
        version = httpx.get(servers[0][1] + "/server_info", timeout=30).json().get("version", "?")
        ran("SGLang (its server, real)", f"{version}, two up in {time.monotonic() - start:.0f} s")
        yield [SGLangServer(url, tiny_checkpoint, proc.log) for proc, (_, url) in zip(procs, servers)]


@pytest.fixture(scope="session")
def sglang_server(sglang_servers):
    """The first of the session's SGLang servers: ``(url, checkpoint)``."""
    return sglang_servers[0].url, sglang_servers[0].checkpoint


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
