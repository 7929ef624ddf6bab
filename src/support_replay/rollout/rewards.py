"""Rewards: the built-in final-answer check and custom ``module:function`` rewards."""

from __future__ import annotations

import re

from ..errors import SupportReplayError
from .user_code import load_function

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_answer(text: str) -> str | None:
    """The ``\\boxed{...}`` content if any, else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _as_number(text: str | None) -> float | None:
    if text is None:
        return None
    match = _NUMBER.search(text.replace(",", ""))
    return float(match.group()) if match else None


def math_reward(prompt: str, response: str, label) -> float:
    """1.0 when the response's final answer equals the label (numerically when both are numbers)."""
    answer = final_answer(response)
    if answer is None or label is None:
        return 0.0
    a, b = _as_number(answer), _as_number(str(label))
    if a is not None and b is not None:
        return float(abs(a - b) < 1e-6)
    return float(answer.strip() == str(label).strip())


def load_reward(rm_type: str | None, custom_rm_path: str | None):
    """The reward function ``(prompt, response, label) -> float`` of a run."""
    if custom_rm_path:
        return load_function(custom_rm_path, "--custom-rm-path")
    if rm_type == "math":
        return math_reward
    raise SupportReplayError(f"--rm-type={rm_type!r}: unknown reward")
