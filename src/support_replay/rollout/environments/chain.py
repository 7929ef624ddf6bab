"""A multi-turn arithmetic dialogue without tools: the environment gives a start value and one
operation per turn, checks each reply, tells the model the right value, and gives the next
operation. The reward is the share of turns answered with the exact number."""

from __future__ import annotations

import random

from ..data import Prompt
from ..rewards import final_answer

CHAT_TEMPLATE = None  # plain chat: the tokenizer's own template
STEPS = 3


class Tasks:
    def __init__(self, seed: int = 0, max_operand: int = 9):
        self.seed, self.max_operand = seed, max_operand

    def __getitem__(self, i: int) -> Prompt:
        rng = random.Random(f"chain:{self.seed}:{i}")
        start = rng.randint(1, 20)
        ops = [(rng.choice("+-*"), rng.randint(2, self.max_operand)) for _ in range(STEPS)]
        first = f"Start from {start}. {_say(*ops[0])} Reply with the number only."
        encoded = ";".join(f"{op}{n}" for op, n in ops)
        return Prompt([{"role": "user", "content": first}], f"{start}|{encoded}")

    def __len__(self) -> int:
        return 2**31


def _say(op: str, n: int) -> str:
    return {"+": f"Add {n}.", "-": f"Subtract {n}.", "*": f"Multiply by {n}."}[op]


def _apply(value: int, op: str, n: int) -> int:
    return {"+": value + n, "-": value - n, "*": value * n}[op]


def parse_label(label: str) -> tuple[int, list[tuple[str, int]]]:
    start, encoded = label.split("|")
    return int(start), [(item[0], int(item[1:])) for item in encoded.split(";")]


def _correct(text: str | None, value: int) -> bool:
    answer = final_answer(text or "")
    try:
        return answer is not None and float(answer) == value
    except ValueError:
        return False


async def run(client, sample) -> float:
    value, ops = parse_label(sample.label)
    messages, right = sample.messages, 0
    for k, (op, n) in enumerate(ops[: sample.max_turns]):
        value = _apply(value, op, n)
        reply = await client.chat.completions.create(model="support-replay", messages=messages)
        message = reply.choices[0].message
        messages.append({"role": "assistant", "content": message.content or ""})
        right += _correct(message.content, value)
        if reply.choices[0].finish_reason == "length" and not message.content:
            break  # the episode's token budget is spent
        if k + 1 < len(ops):
            verdict = "Correct." if _correct(message.content, value) else f"Not quite: it is {value}."
            messages.append({"role": "user", "content": f"{verdict} {_say(*ops[k + 1])} Reply with the number only."})
    return right / len(ops)
