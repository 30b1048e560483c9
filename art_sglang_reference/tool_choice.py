"""What a chat request's `tools` and `tool_choice` mean for its answer, as SGLang 0.5.17's chat route reads
them (serving_chat.py `_process_messages`, function_call_parser.py `get_structure_constraint`):

- the tools the chat template renders: none for "none", only the named tool for a named choice, else all;
- the constraint on decoding. With a tool-call parser, "required" and a named tool get a structural tag in
  the parser's own markup: the completion starts with a call of one of the request's tools (any of them,
  also for a named choice: SGLang lists every tool in the tag), `<tool_call>{"name":"NAME", "arguments":`
  ARGUMENTS `}</tool_call>` for hermes, ARGUMENTS held to the tool's parameter schema only when the tool
  says `"strict": true` (OpenAI's rule; any JSON value otherwise). After that first call the model writes
  on freely, further calls included. "auto" gets the same tag without the forced start when a tool is
  strict. Without a parser, "required"/named constrain the completion to SGLang's JSON array of calls
  `[{"name": ..., "parameters": {...}}]` (its fallback for formats without a structural tag);
- whether calls are read back: only with a parser (tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .tool_calls import FORMATS, TRIGGER, CallFormat, ToolParsing, tool_names

Tools = list[dict[str, Any]]


@dataclass(frozen=True)
class ToolConstraint:
    """A grammar on decoding, as SGLang's sampling params carry it: its kind and its JSON text."""

    kind: Literal["structural_tag", "json_schema"]
    source: str


@dataclass(frozen=True)
class ToolUse:
    """The tools the chat template renders (None: no tools), the constraint on decoding, how calls are
    read back (None: they stay in the text)."""

    template_tools: Tools | None
    constraint: ToolConstraint | None
    parsing: ToolParsing | None


def tool_use(
    tools: Tools | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    parser: str | None,
) -> ToolUse:
    """What `tools` and `tool_choice` mean with `--tool-call-parser parser`; ValueError (a 400, with
    SGLang's message) for a tool_choice the tools cannot satisfy."""
    named = _named(tool_choice)
    if not tools:
        if tool_choice == "required":
            raise ValueError("Tools cannot be empty if tool choice is set to required.")
        if named is not None:
            raise ValueError("Tools cannot be empty if tool choice is set to a specific tool.")
        return ToolUse(None, None, None)
    names = tool_names(tools)
    if named is not None and named not in names:
        raise ValueError(f"Tool '{named}' not found in tools list.")
    if tool_choice == "none":
        return ToolUse(None, None, None)
    forced = tool_choice == "required" or named is not None
    shown = [tool for tool in tools if _function(tool).get("name") == named] if named is not None else tools
    if parser is None:
        return ToolUse(shown, _calls_schema(tools, named, parallel_tool_calls) if forced else None, None)
    call_format = FORMATS[parser]
    strict = any(_function(tool).get("strict") for tool in tools)
    constraint = _structural_tag(tools, call_format, at_least_one=forced) if forced or strict else None
    return ToolUse(shown, constraint, ToolParsing(names, call_format))


def _named(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function a named tool_choice names (any other value than none/auto/required names one too, so
    that it is refused)."""
    if tool_choice in (None, "none", "auto", "required"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    return str((function or {}).get("name")) if isinstance(function, dict) else str(tool_choice)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function") or {}


def _structural_tag(tools: Tools, call_format: CallFormat, at_least_one: bool) -> ToolConstraint:
    """SGLang's legacy structural tag (`get_legacy_structural_tag`): a call of any of `tools`, its arguments
    any JSON value unless the tool is strict; `at_least_one` makes the completion start with a call."""
    structures = []
    for tool in tools:
        function = _function(tool)
        begin, end = call_format.tag(str(function.get("name")))
        schema = function.get("parameters") if function.get("strict") else None
        structures.append({"begin": begin, "schema": schema or {}, "end": end})
    tag = {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [TRIGGER],
        "at_least_one": at_least_one,
    }
    return ToolConstraint("structural_tag", json.dumps(tag))


def _calls_schema(tools: Tools, named: str | None, parallel_tool_calls: bool) -> ToolConstraint:
    """SGLang's JSON schema of a completion that is only calls (`get_json_schema_constraint`): an array of
    at least one call of the named tool, or of any tool (their `$defs` gathered at the top) for "required";
    one call at most when `parallel_tool_calls` is false."""

    def call(function: dict[str, Any]) -> dict[str, Any]:
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        properties = {"name": {"type": "string", "enum": [function.get("name")]}, "parameters": parameters}
        return {"properties": properties, "required": ["name", "parameters"]}

    functions = [_function(tool) for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if named is not None:
        schema["items"] = call(next(f for f in functions if f.get("name") == named))
    else:
        schema["items"] = {"type": "object", "anyOf": [call(f) for f in functions]}
        defs: dict[str, Any] = {}
        for function in functions:
            for name, definition in ((function.get("parameters") or {}).get("$defs") or {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise ValueError(
                        f"Tool definition '{name}' has multiple schemas, which is not supported."
                    )
        if defs:
            schema["$defs"] = defs
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolConstraint("json_schema", json.dumps(schema))
