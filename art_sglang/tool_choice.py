"""What a chat request's `tools` and `tool_choice` mean for its answer, as SGLang 0.5.17's chat route reads
them (serving_chat.py `_process_messages`, function_call_parser.py `get_structure_constraint`). The gateway
carries it to training (the prompt the template rendered, the grammar decoding ran under) and the reference
engine samples by it, so both follow this one reading:

- the tools the chat template renders: none for "none", only the named tool for a named choice, else all;
- the constraint on decoding. With a tool-call parser, "required" and a named tool get a structural tag in
  the parser's own markup: the completion starts with a call of one of the request's tools (any of them,
  also for a named choice: SGLang lists every tool in the tag), `<tool_call>{"name":"NAME", "arguments":`
  ARGUMENTS `}</tool_call>` for hermes, ARGUMENTS held to the tool's parameter schema only when the tool
  says `"strict": true` (OpenAI's rule; any JSON value otherwise). After that first call the model writes
  on freely, further calls included. "auto" gets the same tag without the forced start when a tool is
  strict. Without a parser, "required"/named constrain the completion to SGLang's JSON array of calls
  `[{"name": ..., "parameters": {...}}]` (its fallback for formats without a structural tag);
- a request with a grammar of its own (regex/ebnf/json_schema/response_format) keeps it: SGLang drops the
  tool constraint ("Constrained decoding is not compatible with tool calls.").

Only the parsers in `MARKUPS` are known here; SGLang's others build model-native tags this module does
not reproduce (`UnknownParser`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .constraints import Grammar

Tools = list[dict[str, Any]]
DEFAULT_PARSER = "hermes"  # SGLangConfig.tool_call_parser's default
# On a choice: the tools its prompt rendered, where they are not the request's.
TEMPLATE_TOOLS_FIELD = "art_template_tools"
TRIGGER = "<tool_call>"  # what starts a call in the structural tag of every parser here


class UnknownParser(ValueError):
    """The tool_choice constrains decoding with a parser whose markup is not known here."""


@dataclass(frozen=True)
class CallMarkup:
    """A parser's markup: what opens and closes one call (SGLang's detector's bot/eot tokens)."""

    start: str
    end: str

    def tag(self, name: str) -> tuple[str, str]:
        """The begin and end of a call of `name` in the structural tag (the detector's structure_info):
        the arguments go between them."""
        return f'{self.start}{{"name":"{name}", "arguments":', "}" + self.end


_QWEN25 = CallMarkup("<tool_call>\n", "\n</tool_call>")
MARKUPS = {"hermes": CallMarkup("<tool_call>", "</tool_call>"), "qwen25": _QWEN25, "qwen": _QWEN25}


@dataclass(frozen=True)
class ToolUse:
    """The tools the chat template renders (None: no tools), the grammar decoding runs under (None: free),
    whether the completion's calls are read back (a parser, and tools offered)."""

    template_tools: Tools | None
    constraint: Grammar | None
    parsed: bool


def tool_names(tools: Tools | None) -> set[str]:
    return {str((t.get("function") or {}).get("name")) for t in tools or [] if isinstance(t, dict)}


def tool_use(
    tools: Tools | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    parser: str | None,
) -> ToolUse:
    """What `tools` and `tool_choice` mean with `--tool-call-parser parser`; ValueError (a 400, with
    SGLang's message) for a tool_choice the tools cannot satisfy, `UnknownParser` when it would constrain
    decoding with a parser not in `MARKUPS`."""
    named = _named(tool_choice)
    if not tools:
        if tool_choice == "required":
            raise ValueError("Tools cannot be empty if tool choice is set to required.")
        if named is not None:
            raise ValueError("Tools cannot be empty if tool choice is set to a specific tool.")
        return ToolUse(None, None, False)
    if named is not None and named not in tool_names(tools):
        raise ValueError(f"Tool '{named}' not found in tools list.")
    if tool_choice == "none":
        return ToolUse(None, None, False)
    forced = tool_choice == "required" or named is not None
    shown = [tool for tool in tools if _function(tool).get("name") == named] if named is not None else tools
    if parser is None:
        return ToolUse(shown, _calls_schema(tools, named, parallel_tool_calls) if forced else None, False)
    strict = any(_function(tool).get("strict") for tool in tools)
    if not (forced or strict):
        return ToolUse(shown, None, True)
    if parser not in MARKUPS:
        raise UnknownParser(
            f"tool_choice {tool_choice!r} constrains decoding with SGLang's --tool-call-parser {parser!r}, "
            f"whose constraint is not reproduced here (known: {', '.join(MARKUPS)})"
        )
    return ToolUse(shown, _structural_tag(tools, MARKUPS[parser], at_least_one=forced), True)


def _named(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function a named tool_choice names (any other value than none/auto/required names one too, so
    that it is refused)."""
    if tool_choice in (None, "none", "auto", "required"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    return str((function or {}).get("name")) if isinstance(function, dict) else str(tool_choice)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function") or {}


def _structural_tag(tools: Tools, markup: CallMarkup, at_least_one: bool) -> Grammar:
    """SGLang's legacy structural tag (`get_legacy_structural_tag`): a call of any of `tools`, its arguments
    any JSON value unless the tool is strict; `at_least_one` makes the completion start with a call."""
    structures = []
    for tool in tools:
        function = _function(tool)
        begin, end = markup.tag(str(function.get("name")))
        schema = function.get("parameters") if function.get("strict") else None
        structures.append({"begin": begin, "schema": schema or {}, "end": end})
    tag = {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [TRIGGER],
        "at_least_one": at_least_one,
    }
    return Grammar(kind="structural_tag", source=json.dumps(tag))


def _calls_schema(tools: Tools, named: str | None, parallel_tool_calls: bool) -> Grammar:
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
    return Grammar(kind="json_schema", source=json.dumps(schema))
