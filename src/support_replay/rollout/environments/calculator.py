"""Arithmetic with a calculator tool: the model may call ``calculator(expression)`` any number
of times, then answers; the reward is 1 for the exact final number, 0 otherwise.

SmolLM2's chat template has no tool branch, so this environment renders with the built-in
Hermes-style template (``hermes_tools``): tools in the system turn, calls as
``<tool_call>{json}</tool_call>``, results as ``<tool_response>`` blocks.
"""

from __future__ import annotations

import ast
import json
import operator
import random

from ..data import Prompt
from ..rewards import final_answer

CHAT_TEMPLATE = "hermes_tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "Solve the problem. Use the calculator tool for arithmetic, then reply with the final number only."


def _shot(k: int, expression: str, result: int) -> list[dict]:
    call = {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{k}", "content": json.dumps({"result": result})},
        {"role": "assistant", "content": str(result)},
    ]


# two worked exchanges in every prompt: without them SmolLM2-135M never writes a tool call
# (0 of 32 samples); with them about a quarter of its first answers do (8 of 32)
DEMONSTRATION = _shot(0, "12 * 3 + 4", 40) + _shot(1, "7 + 8 * 2", 23)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class Tasks:
    """Three-operand questions, deterministic per (seed, index)."""

    def __init__(self, seed: int = 0, max_operand: int = 50):
        self.seed, self.max_operand = seed, max_operand

    def __getitem__(self, i: int) -> Prompt:
        rng = random.Random(f"calculator:{self.seed}:{i}")
        a, b, c = (rng.randint(2, self.max_operand) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        expression = f"{a} {op1} {b} {op2} {c}"
        value = evaluate(expression)
        messages = [
            {"role": "system", "content": SYSTEM},
            *DEMONSTRATION,
            {"role": "user", "content": f"What is {expression}?"},
        ]
        return Prompt(messages, str(int(value)))

    def __len__(self) -> int:
        return 2**31


def evaluate(expression: str) -> float:
    """The value of a plain arithmetic expression (numbers, + - * /, parentheses); ``ValueError`` otherwise."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not plain arithmetic: {ast.dump(node)[:80]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        return walk(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError, RecursionError) as exc:
        raise ValueError(str(exc)) from exc


def call_tool(name: str, arguments: str) -> str:
    """The tool's answer as the model will read it; a bad call gets an error message, not an exception."""
    if name != "calculator":
        return json.dumps({"error": f"unknown tool {name!r}"})
    try:
        expression = json.loads(arguments).get("expression", "")
        value = evaluate(str(expression))
    except (ValueError, AttributeError, TypeError, json.JSONDecodeError) as exc:
        return json.dumps({"error": str(exc)[:200]})
    return json.dumps({"result": int(value) if float(value).is_integer() else round(value, 6)})


def score(text: str, label: str) -> float:
    answer = final_answer(text or "")
    try:
        return float(answer is not None and float(answer) == float(label))
    except ValueError:
        return 0.0


async def run(client, sample) -> float:
    """One episode: model turns until an answer without a tool call, or the turn budget."""
    messages = sample.messages
    for _ in range(sample.max_turns):
        reply = await client.chat.completions.create(model="support-replay", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return score(message.content, sample.label) if choice.finish_reason != "length" or message.content else 0.0
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.function.name,
                    "content": call_tool(call.function.name, call.function.arguments),
                }
            )
    return 0.0
