"""Rewards: the built-in final-answer check, Hugging Face's ``math-verify``, and custom ``module:function``
rewards."""

from __future__ import annotations

import logging
import re
import threading

from ..errors import ConfigError, SupportReplayError
from .user_code import load_function

MATH_VERIFY_TIMEOUT = 5  # seconds per parse and per comparison, where math-verify can time out (the main thread)
MATH_VERIFY_TAIL = 4000  # characters of a response math-verify reads: the final answer is at the end

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


def math_verify_reward(prompt: str, response: str, label) -> float:
    """1.0 when ``math-verify`` (Hugging Face's verifier: LaTeX, fractions, ``\\boxed{}``, units, sets)
    finds the response's answer equal to the label. Its timeouts use ``signal.alarm``, which only the main
    thread has; elsewhere (asynchronous rollouts) it runs without them, on the response's last
    ``MATH_VERIFY_TAIL`` characters."""
    if label is None:
        return 0.0
    from math_verify import parse, verify

    timeout = MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None
    text = str(label)
    # a bare LaTeX label (\\sqrt{2}) parses only between math delimiters, a plain one either way
    gold = (parse(f"${text}$", parsing_timeout=timeout) if "$" not in text else []) or parse(
        text, parsing_timeout=timeout
    )
    answer = parse(response[-MATH_VERIFY_TAIL:], parsing_timeout=timeout)
    return float(verify(gold, answer, timeout_seconds=timeout))


def _math_verify():
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--rm-type=math-verify: the math-verify package is not installed (pip install 'support-replay[math]')"
        ) from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" on every call off the main thread
    return math_verify_reward


def load_reward(rm_type: str | None, custom_rm_path: str | None):
    """The reward function ``(prompt, response, label) -> float`` of a run."""
    if custom_rm_path:
        return load_function(custom_rm_path, "--custom-rm-path")
    if rm_type == "math":
        return math_reward
    if rm_type == "math-verify":
        return _math_verify()
    if rm_type == "reasoning_gym":
        from .reasoning_gym_tasks import _reasoning_gym, reasoning_gym_reward

        _reasoning_gym()  # installed, or refused by name now
        return reasoning_gym_reward
    raise SupportReplayError(f"--rm-type={rm_type!r}: unknown reward")
