"""Tool calls in completions, as SGLang 0.5.17 returns them with `--tool-call-parser`.

The reference engine reads the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` markup that the
`hermes`, `qwen25` and `qwen` parsers read (Hermes-style and Qwen2.5 chat templates render tool calls
this way; whitespace around the JSON is allowed). As SGLang's detector does: the text before the first
`<tool_call>` stays the message content, each JSON object after a `<tool_call>` naming one of the
request's tools becomes a call (arguments re-serialised as JSON text), and a stop becomes
`finish_reason="tool_calls"`. A stream holds text back from the first `<tool_call>` on and sends the calls
when the completion ends.

With `tool_choice="required"` or a named tool SGLang instead constrains decoding to a JSON array of calls
(`call_grammar.py`) and reads the whole completion as that array.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PARSERS = ("hermes", "qwen25", "qwen")
START, END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int) -> dict[str, Any]:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "index": index,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    return {str((t.get("function") or {}).get("name")) for t in tools or [] if isinstance(t, dict)}


@dataclass
class ToolParsing:
    """How a chat request's completions become calls: `<tool_call>` markup naming one of `names`, or,
    when `forced` (tool_choice "required" or a named tool), the whole completion read as the JSON array
    of calls decoding was constrained to; `max_calls` is 1 for a named tool."""

    names: set[str]
    forced: bool = False
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls), or None when the completion holds no calls (it stays the content)."""
        if not self.forced:
            return parse(text, self.names)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:  # cut off by max_tokens
            return None
        calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
        return "", calls

    def splitter(self) -> StreamSplitter:
        """What a stream holds back: from the first `<tool_call>` on, or everything when forced."""
        return StreamSplitter(in_call=self.forced)


def parse(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    """(content before the calls, calls), or None when `text` holds no tool-call markup."""
    first = text.find(START)
    if first == -1:
        return None
    calls: list[ToolCall] = []
    position = first
    while (start := text.find(START, position)) != -1:
        cursor = start + len(START)
        while cursor < len(text) and text[cursor] in " \t\r\n":
            cursor += 1
        try:
            value, position = _DECODER.raw_decode(text, cursor)
        except json.JSONDecodeError:
            break  # a truncated call: the ones after it cannot be found reliably either
        for action in value if isinstance(value, list) else [value]:
            name = action.get("name") if isinstance(action, dict) else None
            if name in names:
                arguments = action.get("parameters") or action.get("arguments", {})
                calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            else:
                logger.warning("the model called a function the request does not offer: %r", name)
    return text[:first].strip(), calls


class StreamSplitter:
    """Splits streamed text into what can be sent as content now and the held-back tool-call part."""

    def __init__(self, in_call: bool = False) -> None:
        self.held = ""
        self.in_call = in_call

    def push(self, piece: str) -> str:
        """Add streamed text; return the content that is certainly not part of a tool call."""
        if self.in_call:
            self.held += piece
            return ""
        text = self.held + piece
        at = text.find(START)
        if at != -1:
            self.in_call = True
            self.held = text[at:]
            return text[:at]
        keep = next(
            (k for k in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-k:])), 0
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self, parsing: ToolParsing) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls) once the completion ended."""
        rest, self.held = self.held, ""
        if not self.in_call:
            return rest, []
        parsed = parsing.parse(rest)
        return ("", parsed[1]) if parsed is not None else (rest, [])
