"""Prompt data: JSONL or Parquet files, reasoning-gym tasks, and the built-in arithmetic task."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import SupportReplayError


@dataclass
class Prompt:
    content: str | list[dict]  # plain text, or chat messages
    label: str | None = None


class ArithmeticTask:
    """Endless deterministic two-operand arithmetic questions with exact answers."""

    def __init__(self, seed: int = 0, max_operand: int = 20):
        self.seed, self.max_operand = seed, max_operand

    def __getitem__(self, i: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{i}")
        a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
        op = rng.choice(["+", "-", "*"])
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}? Give only the final number."
        return Prompt([{"role": "user", "content": question}], str(answer))

    def __len__(self) -> int:
        return 2**31


class ListPrompts:
    def __init__(self, prompts: list[Prompt]):
        if not prompts:
            raise SupportReplayError("prompt data: no prompts")
        self.prompts = prompts

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i % len(self.prompts)]

    def __len__(self) -> int:
        return len(self.prompts)


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SupportReplayError(f"{path}:{n}: not valid JSON ({exc})") from exc
    return rows


def load_prompts(path: str | None, input_key: str, label_key: str, seed: int = 0, max_operand: int = 20):
    """Prompts from a JSONL/Parquet file (``input_key`` text or chat messages, ``label_key``), a reasoning-gym
    task (``reasoning_gym:NAME``), or the arithmetic task."""
    if path is None:
        return ArithmeticTask(seed, max_operand)
    from .reasoning_gym_tasks import PREFIX, ReasoningGymTask

    if path.startswith(PREFIX):
        return ReasoningGymTask(path[len(PREFIX) :], seed)
    p = Path(path)
    if not p.exists():
        raise SupportReplayError(f"--prompt-data={path!r}: no such file")
    prompts = []
    for n, row in enumerate(_rows(p)):
        if input_key not in row:
            raise SupportReplayError(f"--prompt-data={path!r} row {n}: no field {input_key!r} (--input-key)")
        content = row[input_key]
        if not isinstance(content, (str, list)):
            raise SupportReplayError(f"--prompt-data={path!r} row {n}: {input_key!r} must be text or chat messages")
        label = row.get(label_key)
        prompts.append(Prompt(content, None if label is None else str(label)))
    return ListPrompts(prompts)
