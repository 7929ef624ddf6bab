"""support-replay: bounded sampling-support replay for RL post-training.

This namespace re-exports the core (``support_replay.core``, torch and numpy alone): the
support table, the wire codec, sampling with capture, penalties and logit bias,
log-probabilities, their parallel forms and the losses. The engine, the HTTP servers, the
backends, rollouts and the trainer are subpackages built on it (``support_replay.engine``,
``.serving``, ``.backends``, ``.rollout``, ``.train``).
"""

from .core import wire
from .core.logprobs import (
    entropy,
    full_logprobs,
    full_logprobs_and_entropy,
    penalised_support_logprobs,
    sparse_head_support_logprobs,
    support_logprobs,
)
from .core.penalties import Penalties, penalise
from .core.sampling import SEMANTICS, SampledTokens, SamplingParams, sample_tokens, support_mask
from .core.support import SupportTable
from .errors import SamplingParamsError, SupportError, SupportReplayError, WireError

__version__ = "0.1.0"

__all__ = [
    "Penalties",
    "SEMANTICS",
    "SampledTokens",
    "SamplingParams",
    "SamplingParamsError",
    "SupportError",
    "SupportReplayError",
    "SupportTable",
    "WireError",
    "entropy",
    "full_logprobs",
    "full_logprobs_and_entropy",
    "penalise",
    "penalised_support_logprobs",
    "sample_tokens",
    "sparse_head_support_logprobs",
    "support_logprobs",
    "support_mask",
    "wire",
]
