"""reasoning-gym's procedurally generated tasks as prompt data (``--prompt-data reasoning_gym:NAME``) and their
own scorers as the reward (``--rm-type reasoning_gym``), offline. An optional dependency:
``pip install 'support-replay[tasks]'``.

Each prompt is reasoning-gym's default system prompt (think, then answer inside ``<answer>`` tags) and the
task's question; its label names the task, the seed and the index, from which the reward regenerates the
entry and scores the answer with the dataset's ``score_answer``."""

from __future__ import annotations

import functools
import json

from ..errors import ConfigError
from .data import Prompt

PREFIX = "reasoning_gym:"
SIZE = 2**31 - 1  # entries are generated from (seed, index) when asked: the size costs nothing
INSTALL = "pip install 'support-replay[tasks]'"


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"reasoning-gym tasks: the reasoning-gym package is not installed ({INSTALL})") from None
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def dataset(name: str, seed: int):
    """The task ``name`` generated with ``seed`` (a ConfigError naming it when reasoning-gym has none)."""
    rg = _reasoning_gym()
    try:
        return rg.create_dataset(name, seed=seed, size=SIZE)
    except ValueError as exc:
        raise ConfigError(f"--prompt-data={PREFIX}{name}: {exc}") from None


class ReasoningGymTask:
    """Endless prompts of one reasoning-gym task."""

    def __init__(self, name: str, seed: int):
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.name, self.seed, self.data = name, seed, dataset(name, seed)
        self.system = SYSTEM_PROMPTS["default"]

    def __getitem__(self, i: int) -> Prompt:
        entry = self.data[i % SIZE]
        label = json.dumps({"task": self.name, "seed": self.seed, "index": i % SIZE})
        return Prompt(
            [{"role": "system", "content": self.system}, {"role": "user", "content": entry["question"]}], label
        )

    def __len__(self) -> int:
        return SIZE


def answer_of(response: str) -> str:
    """The response's answer: inside ``<answer>`` tags as reasoning-gym asks, else its last non-empty line."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response, tag_name="answer")
    if tagged is not None:
        return tagged
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym_reward(prompt: str, response: str, label) -> float:
    """The task's own score (0 to 1) of the response's answer."""
    if label is None:
        return 0.0
    try:
        ref = json.loads(label)
        data, index = dataset(ref["task"], int(ref["seed"])), int(ref["index"])
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--rm-type reasoning_gym: the label {label!r:.80} is not a reasoning-gym prompt's (use --prompt-data "
            f"{PREFIX}NAME) ({exc})"
        ) from None
    entry = data[index]
    return float(data.score_answer(answer_of(response), entry))
