"""The tool dump the chat template sees must be SGLang 0.5.17's, key for key: the trainer re-renders the
prompt the server rendered, and one extra key shifts every token after it (found on an H200: SGLang's
`Tool` dumps its own `defer_loading: null`, which the trainer's prompt lacked)."""

from __future__ import annotations

import json

from art_sglang.chat_format import template_tools

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "description": "Add.",
    },
}


def test_a_tool_is_dumped_as_sglang_0_5_17_dumps_it() -> None:
    # SGLang 0.5.17 protocol.py: Function(description, name, parameters, strict=False, defer_loading
    # popped while None), Tool(type, function, defer_loading=None, always dumped).
    [dumped] = template_tools([ADD]) or []
    assert json.dumps(dumped) == json.dumps(
        {
            "type": "function",
            "function": {
                "description": "Add.",
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "strict": False,
            },
            "defer_loading": None,
        }
    )


def test_a_tools_defer_loading_reaches_its_function() -> None:
    [dumped] = template_tools([{**ADD, "defer_loading": True}]) or []
    assert dumped["defer_loading"] is True and dumped["function"]["defer_loading"] is True
    [own] = template_tools([{**ADD, "function": {**ADD["function"], "defer_loading": False}}]) or []
    assert own["defer_loading"] is None and own["function"]["defer_loading"] is False
    assert template_tools([]) is None
