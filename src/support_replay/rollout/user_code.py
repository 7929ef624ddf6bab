"""Functions the user names on the command line (``--custom-rm-path``, ``--agent-path``)."""

from __future__ import annotations

import importlib

from ..errors import ConfigError


def load_function(spec: str, flag: str):
    """The callable named ``module:function`` (or ``module.function``, Miles' spelling); a
    ``ConfigError`` naming the flag and the value when it cannot be loaded."""
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag}={spec!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{flag}={spec!r}: cannot load it ({type(exc).__name__}: {exc})") from exc
    if not callable(fn):
        raise ConfigError(f"{flag}={spec!r}: {attr} is not callable")
    return fn
