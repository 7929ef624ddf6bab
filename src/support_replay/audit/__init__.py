"""``support-replay audit``: the training-inference mismatch of a setup, split by cause, and a
certificate before a run (docs/audit.md). Built on the trainer's forward and the backends."""

from .run import run_audit, summary
from .settings import AuditSettings

__all__ = ["AuditSettings", "run_audit", "summary"]
