"""Tools and tool calls in the form SGLang hands the chat template, for the reference engine and the
trainer alike: training must render the very prompt the server rendered when it sampled.

SGLang 0.5.17 validates a chat request into its own pydantic models and renders their dumps, so key
order and defaults come from those models, not from the request: a tool becomes
`{"type", "function": {"description", "name", "parameters", "strict"}, "defer_loading": null}` (the
function's own `defer_loading` only when set, inherited from the tool's) and an assistant tool call
`{"id", "index", "type", "function": {"name", "arguments"}}` with its JSON `arguments` decoded to an
object. A template that writes `tool | tojson` shows that order, so the `Trajectory` a program built
(pydantic reorders tool dicts) or the message dump a client sent (openai's `Function` lists `arguments`
first) must be put back into it before rendering.
"""

from __future__ import annotations

import json
from typing import Any


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Tool definitions as SGLang's `Tool.model_dump()` gives them to the template."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            out.append(tool)
            continue
        function = tool.get("function") or {}
        defer_loading = tool.get("defer_loading")
        dumped = {
            "description": function.get("description"),
            "name": function.get("name"),
            "parameters": function.get("parameters"),
            "strict": bool(function.get("strict") or False),
        }
        own = function.get("defer_loading")
        if own is not None or defer_loading is not None:
            dumped["defer_loading"] = own if own is not None else defer_loading
        out.append({"type": tool.get("type", "function"), "function": dumped, "defer_loading": defer_loading})
    return out


def template_tool_calls(calls: list[Any]) -> list[Any]:
    """An assistant message's tool calls as SGLang's `ToolCall.model_dump()` gives them to the template,
    with JSON `arguments` decoded (a string that is not a JSON object stays as it is)."""
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(call)
            continue
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        out.append(
            {
                "id": call.get("id"),
                "index": call.get("index"),
                "type": call.get("type", "function"),
                "function": {"name": function.get("name"), "arguments": arguments},
            }
        )
    return out


def template_messages(messages: list[Any]) -> list[Any]:
    """The messages with their tool calls in template form (everything else as given)."""
    return [
        {**m, "tool_calls": template_tool_calls(m["tool_calls"])}
        if isinstance(m, dict) and m.get("tool_calls")
        else m
        for m in messages
    ]
