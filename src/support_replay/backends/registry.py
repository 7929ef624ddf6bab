"""The engine kinds by name: one line per kind. A kind is chosen once, here, from the run's engine settings.

Without ``--rollout-url`` the run samples from an engine in its own process; with it,
``--rollout-engine`` names the protocol spoken there. The built-in kinds are imported on first use
(the in-process kind imports the engine and the model code, the HTTP kinds neither).
"""

from __future__ import annotations

from importlib import import_module

from ..errors import ConfigError
from .kind import EngineKind

IN_PROCESS = "in-process"
DEFAULT_REMOTE = "sglang"  # --rollout-engine's default
_BUILT_IN = {  # name: (module, class)
    IN_PROCESS: ("support_replay.backends.in_process", "InProcessKind"),
    "sglang": ("support_replay.backends.sglang_kind", "SGLangKind"),
    "vllm": ("support_replay.backends.vllm_kind", "VLLMKind"),
}
_REGISTERED: dict[str, type[EngineKind]] = {}


def register(kind: type[EngineKind]) -> type[EngineKind]:
    """Make ``kind`` a choice of ``--rollout-engine`` (usable as a class decorator)."""
    _REGISTERED[kind.name] = kind
    return kind


def names() -> list[str]:
    return sorted({*_BUILT_IN, *_REGISTERED})


def remote_names() -> list[str]:
    return [name for name in names() if name != IN_PROCESS]


def kind_class(name: str) -> type[EngineKind]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILT_IN:
        raise ConfigError(f"--rollout-engine: one of {remote_names()}, got {name!r}")
    module, cls = _BUILT_IN[name]
    return getattr(import_module(module), cls)


def kind_name(settings) -> str:
    """The kind a run's engine section selects: ``--rollout-engine`` at ``--rollout-url``, else in-process."""
    return settings.rollout_engine if settings.rollout_url else IN_PROCESS


def kind_for(settings, in_process=None) -> EngineKind:
    """The (not yet connected) kind of a run's engine section; ``in_process``: the in-process engine's settings."""
    return kind_class(kind_name(settings))(settings, in_process)
