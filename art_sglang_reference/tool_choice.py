"""What a chat request's `tools` and `tool_choice` mean for the reference engine's answer: SGLang 0.5.17's
reading (art_sglang.tool_choice: the tools the template renders, the grammar on decoding), plus how the
completion's calls are read back (tool_calls.py; only with a parser).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art_sglang import tool_choice as sglang
from art_sglang.constraints import Grammar

from .tool_calls import FORMATS, ToolParsing


@dataclass(frozen=True)
class ToolUse:
    """The tools the chat template renders (None: no tools), the grammar on decoding, how calls are read
    back (None: they stay in the text)."""

    template_tools: sglang.Tools | None
    constraint: Grammar | None
    parsing: ToolParsing | None


def tool_use(
    tools: sglang.Tools | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    parser: str | None,
) -> ToolUse:
    """What `tools` and `tool_choice` mean with `--tool-call-parser parser` (one of `FORMATS`); ValueError
    (a 400, with SGLang's message) for a tool_choice the tools cannot satisfy."""
    use = sglang.tool_use(tools, tool_choice, parallel_tool_calls, parser)
    parsing = ToolParsing(sglang.tool_names(tools), FORMATS[parser]) if use.parsed and parser else None
    return ToolUse(use.template_tools, use.constraint, parsing)
