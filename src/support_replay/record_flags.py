"""Command-line flags generated from a frozen dataclass record, and the record read back from them.

A field's ``metadata`` says its flag: ``help``, ``flags`` (aliases, e.g. SGLang's names), ``choices``, ``type``
(where the default is None), ``off`` (the switch that turns a default-True field off, e.g.
``--disable-radix-cache``), and ``flag: False`` for a field set another way. ``record_args`` is the
reverse: the flags that give a record's non-default values to a command line (the engines a run starts).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def flag_fields(cls) -> list:
    return [f for f in fields(cls) if f.metadata.get("flag", True)]


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def _names(f) -> list[str]:
    return ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]


def flag_names(cls) -> set[str]:
    """The flags ``record_args`` may write for a record of ``cls``."""
    out = set()
    for f in flag_fields(cls):
        default = _default(f)
        out.add(f.metadata["off"] if isinstance(default, bool) and default else _names(f)[0])
    return out


def add_record_flags(group, cls) -> None:
    """One flag per field of the dataclass ``cls``, its default the field's."""
    for f in flag_fields(cls):
        meta, default = f.metadata, _default(f)
        if isinstance(default, bool):
            if default:  # on by default: its switch turns it off
                group.add_argument(meta["off"], dest=f.name, action="store_false", help=meta.get("help"))
            else:
                group.add_argument(*_names(f), dest=f.name, action="store_true", help=meta.get("help"))
            continue
        kind = meta.get("type") or type(default)
        group.add_argument(
            *_names(f), dest=f.name, type=kind, default=default, choices=meta.get("choices"), help=meta.get("help")
        )


def record_from_args(cls, args: argparse.Namespace, **given):
    """The record ``cls`` of the parsed flags (``given``: fields set another way)."""
    return cls(**{f.name: getattr(args, f.name) for f in flag_fields(cls)}, **given)


def record_args(record) -> list[str]:
    """The flags that give ``record``'s values that differ from its defaults."""
    out = []
    for f in flag_fields(type(record)):
        value, default = getattr(record, f.name), _default(f)
        if value == default:
            continue
        if isinstance(default, bool):
            out.append(f.metadata["off"] if default else _names(f)[0])
        else:
            out += [_names(f)[0], str(value)]
    return out
