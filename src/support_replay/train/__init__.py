"""Training: the FSDP2 actor, its two scores per token, the GRPO recipe, weight sync, checkpoints."""

from ..errors import CITestError
from .config import RunConfig
from .loop import train

__all__ = ["CITestError", "RunConfig", "train"]
