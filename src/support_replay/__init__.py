"""support-replay: bounded sampling-support replay for RL post-training.

The core (this namespace) depends on torch and numpy alone.
"""

from .errors import SamplingParamsError, SupportError, SupportReplayError, WireError
from .logprobs import entropy, full_logprobs, full_logprobs_and_entropy, sparse_head_support_logprobs, support_logprobs
from .sampling import SEMANTICS, SampleResult, SamplingParams, sample, support_mask
from .support import SupportTable

__version__ = "0.1.0"

__all__ = [
    "SEMANTICS",
    "SampleResult",
    "SamplingParams",
    "SamplingParamsError",
    "SupportError",
    "SupportReplayError",
    "SupportTable",
    "WireError",
    "entropy",
    "full_logprobs",
    "full_logprobs_and_entropy",
    "sample",
    "sparse_head_support_logprobs",
    "support_logprobs",
    "support_mask",
]
