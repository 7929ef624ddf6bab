"""Training: the FSDP2 actor, its two scores per token, the GRPO recipe, weight sync, checkpoints."""

from .loop import CITestError, train

__all__ = ["CITestError", "train"]
