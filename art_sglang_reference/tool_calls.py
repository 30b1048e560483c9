"""Tool calls in completions, as SGLang 0.5.17 reads them with `--tool-call-parser`.

Each parser has its call markup: `hermes` `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
`qwen25`/`qwen` the same with a newline inside each tag. Its reading follows SGLang's detector
(`detect_and_parse`): the text before the first call stays the message content (stripped), each call's
JSON naming one of the request's tools becomes a call (arguments re-serialised as JSON text), other names
are skipped, and what follows the calls is dropped. They differ on a call that is not JSON (cut off by
max_tokens): hermes then returns no calls and the whole text as content, qwen25 skips that call (and
only reads closed calls). A stream holds text back from the first call on and sends the calls when the
completion ends.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from art_sglang.tool_choice import MARKUPS, CallMarkup

logger = logging.getLogger(__name__)


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


# (content, calls): the message's content and the calls read from a completion.
Reading = tuple[str, list[ToolCall]]


@dataclass(frozen=True)
class CallFormat(CallMarkup):
    """A parser's markup (art_sglang.tool_choice) and how a completion is read."""

    read: Callable[[str, set[str]], Reading]


_NOT_CALLS = (AttributeError, TypeError)  # what reading JSON that is not call objects raises


def _calls(value: Any, names: set[str]) -> list[ToolCall]:
    """The calls in one call's JSON (an object or a list of them), unknown names skipped; JSON that is
    not call objects raises one of `_NOT_CALLS`, as SGLang's `parse_base_json` does."""
    calls = []
    for action in value if isinstance(value, list) else [value]:
        name = action.get("name")
        if name in names:
            arguments = action.get("parameters") or action.get("arguments", {})
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        else:
            logger.warning("the model called a function the request does not offer: %r", name)
    return calls


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_QWEN25_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def _read_hermes(text: str, names: set[str]) -> Reading:
    first = text.find("<tool_call>")
    if first == -1:
        return text, []
    calls: list[ToolCall] = []
    try:
        for closed, unclosed in _HERMES_CALL.findall(text):
            raw = closed or unclosed
            if raw:
                calls.extend(_calls(json.loads(raw.strip()), names))
    except (ValueError, *_NOT_CALLS):  # SGLang catches every error here and keeps the text
        return text, []
    return text[:first].strip(), calls


def _read_qwen25(text: str, names: set[str]) -> Reading:
    first = text.find("<tool_call>\n")
    if first == -1:
        return text, []
    calls: list[ToolCall] = []
    for raw in _QWEN25_CALL.findall(text):
        try:
            value = json.loads(raw.strip())
        except json.JSONDecodeError:
            continue
        try:
            calls.extend(_calls(value, names))
        except _NOT_CALLS:  # raised through SGLang's detector: its chat route keeps the text
            return text, []
    return text[:first].strip(), calls


_READERS = {"hermes": _read_hermes, "qwen25": _read_qwen25, "qwen": _read_qwen25}
FORMATS = {name: CallFormat(markup.start, markup.end, _READERS[name]) for name, markup in MARKUPS.items()}


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's completions become calls: the parser's markup naming one of `names`."""

    names: set[str]
    format: CallFormat

    def parse(self, text: str) -> Reading:
        """(content, calls); no calls leaves the completion as SGLang leaves it."""
        return self.format.read(text, self.names)

    def splitter(self) -> StreamSplitter:
        return StreamSplitter(self.format.start)


class StreamSplitter:
    """Splits streamed text into what can be sent as content now and the held-back tool-call part."""

    def __init__(self, start: str) -> None:
        self.start = start
        self.held = ""
        self.in_call = False

    def push(self, piece: str) -> str:
        """Add streamed text; return the content that is certainly not part of a tool call."""
        if self.in_call:
            self.held += piece
            return ""
        text = self.held + piece
        at = text.find(self.start)
        if at != -1:
            self.in_call = True
            self.held = text[at:]
            return text[:at]
        keep = next(
            (
                k
                for k in range(min(len(self.start) - 1, len(text)), 0, -1)
                if self.start.startswith(text[-k:])
            ),
            0,
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self, parsing: ToolParsing) -> Reading:
        """(content still to send, the calls) once the completion ended."""
        rest, self.held = self.held, ""
        return parsing.parse(rest) if self.in_call else (rest, [])
