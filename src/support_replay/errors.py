"""The exception types of support-replay.

Every rejection (bad support metadata, malformed wire bytes, unsupported sampling
settings) raises a subclass of ``SupportReplayError`` whose message names the field,
the sample or row, and the offending value.
"""


class SupportReplayError(ValueError):
    """Base class: input that the replay contract cannot accept."""


class SupportError(SupportReplayError):
    """A support table violates an invariant (empty row, duplicate id, id out of range...)."""


class WireError(SupportReplayError):
    """Encoded support bytes or an engine payload are malformed or incomplete."""


class SamplingParamsError(SupportReplayError):
    """Sampling settings that are invalid, or that replay cannot reproduce faithfully."""
