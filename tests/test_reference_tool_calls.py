"""The reference engine's reading of `<tool_call>` markup (SGLang's hermes/qwen25 parsers), whole and
streamed, on the texts a model produces."""

from __future__ import annotations

import json

from art_sglang_reference.call_grammar import CallGrammar
from art_sglang_reference.tool_calls import StreamSplitter, ToolParsing, parse

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
    rest, calls = splitter.finish(ToolParsing(NAMES))
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    plain = StreamSplitter()
    assert plain.push("a <to") == "a " and plain.finish(ToolParsing(NAMES)) == ("<to", [])


def _walk(grammar: CallGrammar, text: str, vocabulary: list[str]) -> bool:
    """Feed `text` one character (token) at a time; False as soon as the mask refuses one."""
    for char in text:
        if not grammar.mask(set())[vocabulary.index(char)]:
            return False
        grammar.accept(char)
    return True


def test_the_call_grammar_accepts_exactly_arrays_of_calls_of_offered_tools() -> None:
    vocabulary = [chr(i) for i in range(32, 127)] + ["</s>"]
    eos = {len(vocabulary) - 1}
    calls = [
        {"name": "add", "parameters": {"a": 1, "b": [2, -3.5e2, True, None, 'q"\\u00e9']}},
        {"name": "mul", "parameters": {"x": {"y": {}}, "s": ""}},
    ]
    whole = CallGrammar(["add", "mul"], None, vocabulary)
    assert _walk(whole, json.dumps(calls), vocabulary)
    assert whole.mask(eos).nonzero().flatten().tolist() == sorted(eos)  # complete: only the end is allowed
    for refused in (
        "[]",  # at least one call
        '[{"name": "rm", "parameters": {}}]',  # a tool not offered
        '[{"name": "add", "parameters": [1]}]',  # parameters are an object
        '[{"name": "add", "parameters": {"a": 01}}]',  # not JSON
        '[{"name":"add", "parameters": {}}]',  # json.dumps spelling only
    ):
        assert not _walk(CallGrammar(["add", "mul"], None, vocabulary), refused, vocabulary), refused
    one = json.dumps(calls[1:])
    assert _walk(CallGrammar(["mul"], 1, vocabulary), one, vocabulary)
    assert not _walk(
        CallGrammar(["mul"], 1, vocabulary), one[:-1] + ", ", vocabulary
    )  # a named tool: one call
    unfinished = CallGrammar(["add"], None, vocabulary)
    assert _walk(unfinished, '[{"name": "add", "parameters": {}}', vocabulary)
    assert not unfinished.mask(eos)[len(vocabulary) - 1]  # the array is not closed: no end yet


def test_a_forced_completion_is_read_as_the_array() -> None:
    parsing = ToolParsing({"add"}, forced=True)
    content, calls = parsing.parse('[{"name": "add", "parameters": {"a": 1}}]')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    assert parsing.parse('[{"name": "add", "parameters": {"a": 1') is None  # cut off: stays the content
    splitter = parsing.splitter()
    assert splitter.push('[{"name": "add", ') == "" and splitter.push('"parameters": {}}]') == ""
    assert splitter.finish(parsing)[1][0].name == "add"
