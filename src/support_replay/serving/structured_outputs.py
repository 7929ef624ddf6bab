"""Structured-output requests as llguidance grammars for the engine (``engine/grammar.py``).

- OpenAI's ``response_format``: ``json_object`` (any object) or ``json_schema`` (its ``schema``);
- forced tool calls: ``tool_choice: "required"`` (one call to any of the tools) or a named function, as
  one Hermes block ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` whose arguments
  follow the tool's parameter schema (what ``parse_tool_calls`` reads back);
- vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and SGLang's
  ``json_schema``, ``regex`` and ``ebnf`` sampling parameters.

JSON is written as Python's ``json.dumps`` writes it (separators ``", "`` and ``": "``, no other
whitespace): a sampled model cannot pad an answer with spaces until its token budget runs out, and a
forced tool call reads back and renders again (the chat template) to the very same text, so a
session's next turn extends it instead of splitting.
"""

from __future__ import annotations

import json

from ..errors import RequestError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _ll():
    import llguidance

    return llguidance


def json_schema_grammar(schema, where: str) -> str:
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return _ll().LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{where}: not a JSON schema llguidance takes: {exc}") from exc


def response_format_grammar(response_format: dict | None) -> str | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("response_format.json_schema: needs {'name': ..., 'schema': {...}}")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise RequestError(f"response_format.type={kind!r}: one of 'text', 'json_object', 'json_schema'")


def _tool_names(tools: list[dict] | None) -> dict[str, dict]:
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        out[fn["name"]] = fn.get("parameters") or {"type": "object"}
    return out


def tool_choice_grammar(tool_choice, tools: list[dict] | None) -> str | None:
    """The grammar of one forced Hermes tool call, or None when the choice forces none (auto, none)."""
    if tool_choice in (None, "auto", "none"):
        return None
    named = _tool_names(tools)
    if tool_choice == "required":
        names = list(named)
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        names = [tool_choice["function"]["name"]]
        if names[0] not in named:
            raise RequestError(f"tool_choice: function {names[0]!r} is not among the request's tools {list(named)}")
    else:
        raise RequestError(
            f"tool_choice={tool_choice!r}: one of 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if not names:
        raise RequestError(f"tool_choice={tool_choice!r}: the request has no tools to call")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": named[name]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
    return _ll().grammar_from("lark", lark)


def vllm_grammar(structured_outputs: dict | None, where: str = "structured_outputs") -> str | None:
    """vLLM's ``StructuredOutputsParams``: exactly one of json, json_object, regex, choice, grammar."""
    if not structured_outputs:
        return None
    kinds = ("json", "json_object", "regex", "choice", "grammar")
    given = {k: v for k, v in structured_outputs.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(kinds))
    if unknown:
        raise RequestError(f"{where}: {unknown} are not implemented (one of {list(kinds)})")
    if len(given) != 1:
        raise RequestError(f"{where}: give exactly one of {list(kinds)}, got {sorted(given)}")
    (kind, value), ll = next(iter(given.items())), _ll()
    if kind == "json":
        return json_schema_grammar(value, f"{where}.json")
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, f"{where}.json_object")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value) or not value:
            raise RequestError(f"{where}.choice: a non-empty list of strings, got {value!r:.80}")
        return ll.grammar_from("choice", json.dumps(value))
    return _from_text(kind if kind == "regex" else "grammar", value, f"{where}.{kind}")


def sglang_grammar(json_schema, regex, ebnf, grammar=None) -> str | None:
    """SGLang's sampling parameters json_schema, regex, ebnf, or ours, ``grammar`` (llguidance's serialized
    form, as ``SGLangBackend`` forwards a session's constraint): at most one."""
    fields = {"json_schema": json_schema, "regex": regex, "ebnf": ebnf, "grammar": grammar}
    given = {k: v for k, v in fields.items() if v is not None}
    if len(given) > 1:
        raise RequestError(f"sampling_params: give at most one of {list(fields)}, got {sorted(given)}")
    if not given:
        return None
    (kind, value) = next(iter(given.items()))
    if kind == "json_schema":
        return json_schema_grammar(value, "sampling_params.json_schema")
    if kind == "grammar":
        return _from_text("llguidance", value, "sampling_params.grammar")
    return _from_text("regex" if kind == "regex" else "grammar", value, f"sampling_params.{kind}")


def _from_text(kind: str, value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}: a non-empty string, got {value!r:.80}")
    ll = _ll()
    try:
        grammar = ll.grammar_from(kind, value)
    except ValueError as exc:
        raise RequestError(f"{where}: {exc}") from exc
    error = ll.LLMatcher.validate_grammar(grammar)  # the engine checks it against its tokenizer once more
    if error:
        raise RequestError(f"{where}: {error.splitlines()[0]}")
    return grammar
