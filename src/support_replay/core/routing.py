"""Expert routing of a mixture-of-experts model: its shape, its two wire forms, and its checks.

A routing array holds, for every routed position of a sequence and every decoder layer, the
top-k expert ids the router chose: ``[positions, layers, top_k]``, positions in sequence order
(prompt then output), in the router's top-k order. The last sampled token is never fed to the
model, so a sequence of ``P`` prompt and ``T`` output tokens has ``P + T - 1`` routed positions
(both SGLang and vLLM return that). ``layers`` counts every decoder layer, as both engines do;
a layer without experts (Qwen's ``mlp_only_layers``) has a row that is never read.

Wire forms, both read from the engines' own code:

- SGLang 0.5.23 (``meta_info["routed_experts"]``, ``managers/tokenizer_manager.py``): base64 of
  the raw int32 bytes, no header; the reader must know ``layers`` and ``top_k``.
- vLLM 0.32 (``routed_experts``, ``utils/serial_utils.numpy2base64``): base64 of a ``.npy`` file,
  uint8 for up to 256 experts, else uint16 (``routed_experts_capturer.py``). Self-describing and
  the fewest bytes the expert count allows: our compact form.

``-1`` in an array handed to the trainer's router means "route this position freely" (a
position no engine routed: the last sampled token, padding).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import numpy as np

from ..errors import WireError

MAX_ROUTING_BYTES = 1 << 28  # a decoded routing array larger than this is refused before it is allocated
FREE = -1  # "no captured choice here": the trainer's router picks its own top-k


@dataclass(frozen=True)
class RoutingShape:
    """What a model's routing looks like: decoder ``layers`` (all of them), ``top_k`` experts per
    token, ``num_experts`` per layer, and which layers have experts."""

    layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]

    def __post_init__(self):
        if self.layers < 1 or self.top_k < 1 or self.num_experts < self.top_k:
            raise WireError(f"routing shape: layers={self.layers}, top_k={self.top_k}, experts={self.num_experts}")

    @property
    def dtype(self) -> np.dtype:
        return compact_dtype(self.num_experts)

    def bytes_per_token(self, dtype: np.dtype | None = None) -> int:
        """Raw bytes of one position's routing (before base64) in ``dtype`` (default: the compact one)."""
        return self.layers * self.top_k * np.dtype(dtype or self.dtype).itemsize


def compact_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned type that holds every expert id (vLLM's rule, extended past 65536)."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def encode_npy(routing: np.ndarray, num_experts: int) -> str:
    """vLLM's form: base64 of the ``.npy`` bytes of ``routing`` in the compact dtype."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routing, dtype=compact_dtype(num_experts)), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_int32(routing: np.ndarray) -> str:
    """SGLang's form: base64 of the raw little-endian int32 bytes (row-major), no header."""
    return base64.b64encode(np.ascontiguousarray(routing, dtype="<i4").tobytes()).decode("ascii")


def _b64(value, where: str) -> bytes:
    if not isinstance(value, str):
        raise WireError(f"{where}: routed_experts must be a base64 string, got {type(value).__name__}")
    if len(value) > MAX_ROUTING_BYTES * 4 // 3 + 4:
        raise WireError(f"{where}: routed_experts of {len(value)} characters exceeds the limit")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{where}: routed_experts is not base64: {exc}") from None


def decode_npy(value, where: str) -> np.ndarray:
    """vLLM's form back to an int32 ``[positions, layers, top_k]`` array (no pickle, size checked)."""
    raw = _b64(value, where)
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise WireError(f"{where}: routed_experts is not a .npy array: {exc}") from None
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "iu":
        raise WireError(
            f"{where}: routed_experts must be an integer [positions, layers, top_k] array, got "
            f"{getattr(array, 'dtype', type(array).__name__)} of shape {getattr(array, 'shape', None)}"
        )
    return array.astype(np.int32)


def decode_int32(value, layers: int, top_k: int, where: str) -> np.ndarray:
    """SGLang's form back to ``[positions, layers, top_k]``; the byte count must be whole positions."""
    raw = _b64(value, where)
    per_position = 4 * layers * top_k
    if len(raw) % per_position:
        raise WireError(
            f"{where}: routed_experts has {len(raw)} bytes, not a whole number of positions of "
            f"{layers} layers x {top_k} experts x 4 bytes"
        )
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k).astype(np.int32)


def routing_problem(routing: np.ndarray, positions: int, shape: RoutingShape | None) -> str | None:
    """Why ``routing`` is not a valid routing of ``positions`` positions of a model of ``shape``
    (naming the position and layer), or None. Only the layers with experts are checked; without a
    ``shape`` only the array's form and position count."""
    if routing.ndim != 3:
        return f"routing of {routing.ndim} dimensions, expected [positions, layers, top_k]"
    if routing.shape[0] != positions:
        return f"routing for {routing.shape[0]} positions, expected {positions}"
    if shape is None:
        return None
    if routing.shape[1] != shape.layers:
        return f"routing for {routing.shape[1]} layers, the model has {shape.layers}"
    if routing.shape[2] != shape.top_k:
        return f"routing of top-{routing.shape[2]}, the model routes each token to {shape.top_k} experts"
    moe = routing[:, list(shape.moe_layers)]
    bad = (moe < 0) | (moe >= shape.num_experts)
    if bad.any():
        t, layer, _ = (int(v) for v in np.argwhere(bad)[0])
        return (
            f"position {t} layer {shape.moe_layers[layer]}: expert id {int(moe[t, layer][bad[t, layer]][0])} "
            f"outside [0, {shape.num_experts})"
        )
    ordered = np.sort(moe, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    if repeated.any():
        t, layer = (int(v) for v in np.argwhere(repeated)[0])
        return f"position {t} layer {shape.moe_layers[layer]}: expert ids {moe[t, layer].tolist()} repeat an expert"
    return None


def routing_agreement(own: np.ndarray, captured: np.ndarray) -> tuple[int, int]:
    """``(token-layer choices whose top-k sets are equal, choices compared)`` over rows where
    ``captured`` is not ``FREE``; the order within a top-k does not count."""
    live = (captured >= 0).all(-1)
    same = (np.sort(own, -1) == np.sort(captured, -1)).all(-1) & live
    return int(same.sum()), int(live.sum())


def needed_history(history: list[np.ndarray], final: np.ndarray) -> list[np.ndarray]:
    """``history`` (earlier computations of a prefix, oldest first, each shorter than the next) without those that
    routed every position they cover as the computation after them did: their tokens are scored under the later
    routing exactly, and routing replay spends no forward on them (the common case: a re-prefill that routed
    every decoded token as its decode step had)."""
    kept, after = [], final
    for earlier in reversed(history):
        if not np.array_equal(earlier, after[: len(earlier)]):
            kept.append(earlier)
        after = earlier
    return kept[::-1]
