from contextlib import contextmanager

import pytest


@pytest.fixture
def unbuildable_kernels(monkeypatch, tmp_path):
    """``with unbuildable_kernels():`` the project's CPU kernels fail to build (a source that is not C++, an empty
    cache) and every cached build and check is forgotten, before and after, so the rest of the session builds
    them again as it did."""
    from support_replay.modeling import cpu_kernels, decode_attention, decode_layer, top_candidates

    cached = (cpu_kernels.built, decode_attention.compiled, decode_layer.compiled, top_candidates.compiled)

    @contextmanager
    def failing():
        broken = tmp_path / "broken.cpp"
        broken.write_text("this is not C++\n")
        monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
        monkeypatch.setenv("SUPPORT_REPLAY_CACHE", str(tmp_path / "cache"))
        for function in cached:
            function.cache_clear()
        try:
            yield
        finally:
            for function in cached:
                function.cache_clear()

    return failing
