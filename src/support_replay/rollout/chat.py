"""Chat rendering for sessions: messages in the shape a template sees them, the template (the
tokenizer's or a file), and Hermes-style tool calls parsed out of model text.

Messages are compared and rendered in one normal form (``normalize_message``): OpenAI clients
send back assistant messages with extra null fields (``refusal``, ``audio``, ...), and a
history check must not see those as edits.
"""

from __future__ import annotations

import json
import re
import uuid
from importlib import resources
from pathlib import Path

from ..errors import RequestError
from .text_bound import TextBound

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
ROLES = ("system", "user", "assistant", "tool", "developer")


def builtin_template(name: str = "hermes_tools") -> str:
    """A template shipped with the package (``rollout/templates/NAME.jinja``)."""
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text()


def load_template(path: str | None) -> str | None:
    """``--chat-template``: a file, or the name of a built-in template; ``None`` keeps the tokenizer's."""
    if path is None:
        return None
    if Path(path).is_file():
        return Path(path).read_text()
    try:
        return builtin_template(path)
    except FileNotFoundError:
        raise RequestError(
            f"chat_template: {path!r} is neither a file nor a built-in template (hermes_tools)"
        ) from None


def normalize_tool_call(call, where: str) -> dict:
    try:
        function = call["function"]
        name, arguments = function["name"], function.get("arguments", "{}")
    except (KeyError, TypeError):
        raise RequestError(f"{where}: a tool call needs function.name, got {call!r:.120}") from None
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call.get("id") or "",
        "type": call.get("type") or "function",
        "function": {"name": name, "arguments": arguments},
    }


def normalize_message(message: dict, index: int) -> dict:
    """The fields a template reads, without nulls; content lists of text parts joined."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{where}: a message needs a role in {ROLES}, got {message!r:.120}")
    out = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
    content = out.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) != len(content):
            raise RequestError(f"{where}: only text content parts can be rendered, got {content!r:.120}")
        out["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}: content must be a string or text parts, got {type(content).__name__}")
    if out.get("tool_calls"):
        out["tool_calls"] = [
            normalize_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(out["tool_calls"])
        ]
    else:
        out.pop("tool_calls", None)
    if out["role"] == "assistant" and "content" not in out:
        out["content"] = ""  # templates that print content break on None (SmolLM2's does)
    return out


def template_renders_tools(template: str | None, tokenizer) -> bool:
    """Whether the template reads ``tools`` at all: one that does not would drop them silently."""
    source = template if template is not None else getattr(tokenizer, "chat_template", None) or ""
    try:
        from jinja2 import Environment, meta

        return "tools" in meta.find_undeclared_variables(
            Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        )
    except Exception:  # a tag of transformers' own jinja environment: fall back to the text
        return "tools" in source


class ChatRenderer:
    """Renders normalized messages with one template to text, and text to token ids."""

    def __init__(self, tokenizer, template: str | None = None, bound: TextBound | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.renders_tools = template_renders_tools(template, tokenizer)
        self.bound = bound or TextBound()  # text that cannot fit the prompt limit is refused before any work

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        self.bound.check([messages, tools], "messages")
        if tools and not self.renders_tools:
            raise RequestError(
                "tools: the model's chat template cannot render tools; start with --chat-template hermes_tools or a "
                "template that does"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # jinja errors of the template itself
            raise RequestError(
                f"messages: the chat template could not render them: {type(exc).__name__}: {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        self.bound.check(text, "prompt")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Exact text of token ids, special tokens included (what a template renders them as)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def parses_tool_calls(tool_choice) -> bool:
    """OpenAI's ``tool_choice``: ``none`` shows the tools but parses no call out of the output; ``auto``
    (or unset), ``required`` and a named function parse them (the last two force one by a grammar)."""
    return tool_choice != "none"


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """``(content, tool_calls)`` from Hermes-style model text. Anything that does not parse as
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks stays plain content."""
    blocks = list(TOOL_CALL.finditer(text))
    if not blocks or text[blocks[-1].end() :].strip():
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.group(1))
        except json.JSONDecodeError:
            return text, []
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), dict)
        ):
            return text, []
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    content = text[: blocks[0].start()]
    return content[:-1] if content.endswith("\n") else content, calls
