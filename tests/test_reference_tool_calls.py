"""The reference engine's reading of `<tool_call>` markup (SGLang's hermes/qwen25 parsers), whole and
streamed, on the texts a model produces."""

from __future__ import annotations

import json

from art_sglang.server.reference.tool_calls import StreamSplitter, parse

NAMES = {"add", "mul"}


def test_calls_and_the_content_before_them() -> None:
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text += '<tool_call>{"name": "mul", "parameters": {"x": 3}}</tool_call>'
    content, calls = parse(text, NAMES)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("mul", {"x": 3}),
    ]


def test_no_markup_unknown_tools_and_truncated_calls() -> None:
    assert parse("just text", NAMES) is None
    assert parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', NAMES) == ("", [])
    content, calls = parse('ok<tool_call>{"name": "add", "argu', NAMES)
    assert content == "ok" and calls == []


def test_a_stream_holds_back_the_call_and_a_possible_start_of_one() -> None:
    splitter = StreamSplitter()
    pieces = ["Sure", " <tool", "_ca", 'll>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>"]
    sent = [splitter.push(piece) for piece in pieces]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<tool" might start a call: held
    rest, calls = splitter.finish(NAMES)
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    plain = StreamSplitter()
    assert plain.push("a <to") == "a " and plain.finish(NAMES) == ("<to", [])
