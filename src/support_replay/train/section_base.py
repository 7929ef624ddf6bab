"""What every section of the run config shares: frozen pydantic models, flag names, and the rejection
that names the flag and the value."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def bad(name: str, value, why: str):
    """Reject ``value`` of the flag ``name``: ``--flag=value: why``."""
    raise ValueError(f"{flag(name)}={value!r}: {why}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
