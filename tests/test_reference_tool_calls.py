"""The reference engine's tool calls as SGLang 0.5.17 makes them: the reading of each parser's markup, whole
and streamed, and what a request's tools and tool_choice do to the prompt, to decoding (which outputs the
constraint lets through) and to the reading of calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from art_sglang.constraints import Grammar, grammars_available
from art_sglang_reference.tool_calls import FORMATS, ToolParsing
from art_sglang_reference.tool_choice import tool_use

NAMES = {"add", "mul"}
HERMES = ToolParsing(NAMES, FORMATS["hermes"])
QWEN25 = ToolParsing(NAMES, FORMATS["qwen25"])


def _read(parsing: ToolParsing, text: str) -> tuple[str, list[tuple[str, Any]]]:
    content, calls = parsing.parse(text)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_reads_the_calls_and_keeps_the_content_before_them() -> None:
    text = ' Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
    text += '<tool_call> [{"name": "mul", "parameters": {"x": "é"}}, {"name": "rm"}]</tool_call>then more'
    assert _read(HERMES, text) == ("Let me add.", [("add", {"a": 1}), ("mul", {"x": "é"})])
    assert HERMES.parse(text)[1][1].arguments == '{"x": "é"}'  # as SGLang dumps it: not ASCII-escaped
    assert _read(HERMES, "just text ") == ("just text ", [])
    assert _read(HERMES, 'ok <tool_call>{"name": "rm", "arguments": {}}</tool_call>') == ("ok", [])
    assert _read(HERMES, '<tool_call>{"name":"add", "arguments":{}}') == ("", [("add", {})])  # unclosed, JSON


def test_hermes_keeps_the_whole_text_when_a_call_is_not_json() -> None:
    for text in (
        'ok <tool_call>{"name":"add", "arguments":1923819',  # cut off by max_tokens
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "mul", "argu',
        "<tool_call>[1, 2]</tool_call>",
    ):
        assert _read(HERMES, text) == (text, [])


def test_qwen25_reads_only_closed_calls_with_their_newlines() -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = f'Sure. {call}\n<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{{"name": "mul", "argu'
    assert _read(QWEN25, text) == ("Sure.", [("add", {"a": 1})])
    assert _read(QWEN25, 'x <tool_call>{"name": "add", "arguments": {}}</tool_call>')[1] == []


def test_a_stream_holds_back_the_call_and_a_possible_start_of_one() -> None:
    splitter = HERMES.splitter()
    pieces = ["Sure", " <tool", "_ca", 'll>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>"]
    sent = [splitter.push(piece) for piece in pieces]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<tool" might start a call: held
    rest, calls = splitter.finish(HERMES)
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    plain = HERMES.splitter()
    assert plain.push("a <to") == "a " and plain.finish(HERMES) == ("<to", [])
    cut = HERMES.splitter()
    assert cut.push('<tool_call>{"name": "add", "arguments": 12') == ""
    assert cut.finish(HERMES) == ('<tool_call>{"name": "add", "arguments": 12', [])  # not JSON: the text


def _tool(name: str, strict: bool = False, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties or {}, "required": list(properties or {})}
    function = {"name": name, "parameters": parameters, **({"strict": True} if strict else {})}
    return {"type": "function", "function": function}


TOOLS = [_tool("add"), _tool("mul", strict=True, properties={"x": {"type": "integer"}})]


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_the_prompt_shows_the_named_tool_only_and_no_tools_for_none() -> None:
    assert tool_use(TOOLS, "required", True, "hermes").template_tools == TOOLS
    assert tool_use(TOOLS, _named("mul"), True, "hermes").template_tools == TOOLS[1:]
    none = tool_use(TOOLS, "none", True, "hermes")
    assert (none.template_tools, none.constraint, none.parsing) == (None, None, None)
    assert tool_use(TOOLS, None, True, None).parsing is None  # no parser: calls stay in the text


def test_a_tool_choice_the_tools_cannot_meet_is_refused() -> None:
    with pytest.raises(ValueError, match="Tool 'div' not found in tools list"):
        tool_use(TOOLS, _named("div"), True, "hermes")
    with pytest.raises(ValueError, match="Tools cannot be empty if tool choice is set to required"):
        tool_use(None, "required", True, "hermes")
    with pytest.raises(ValueError, match="set to a specific tool"):
        tool_use([], _named("add"), True, None)


@pytest.fixture(scope="module")
def allows(tokenizer: Any) -> Any:
    """allows(constraint, text, complete=False): whether decoding under `constraint` can produce `text`
    (and end right after it, with `complete`)."""
    if not grammars_available():
        pytest.skip("the reference engine samples tool_choice grammars with xgrammar")
    from art_sglang import grammars

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = grammars.GrammarCompiler(tokenizer, len(tokenizer), [eos])

    def check(constraint: Grammar, text: str, complete: bool = False) -> bool:
        matcher = compiler.matcher(constraint)
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                matcher.advance(token)
        except grammars.GrammarError:
            return False
        return not complete or grammars.allows(matcher.bitmask(), eos)

    return check


def test_required_and_named_force_a_call_in_the_parsers_markup(allows: Any) -> None:
    for choice in ("required", _named("mul")):
        constraint = tool_use(TOOLS, choice, True, "hermes").constraint
        assert constraint is not None
        call = '<tool_call>{"name":"add", "arguments":[1, "x"]}</tool_call>'  # not strict: any JSON value
        assert allows(constraint, call + " then text and " + call, complete=True)
        assert allows(
            constraint, '<tool_call>{"name":"mul", "arguments":{"x": 3}}</tool_call>', complete=True
        )
        for refused in (
            " <tool_call>",  # nothing before the call
            "[{",  # not SGLang's JSON array on this path
            '<tool_call>{"name": "add"',  # the parser's exact spelling
            '<tool_call>{"name":"div"',  # a tool not offered
            '<tool_call>{"name":"mul", "arguments":{"x": "3"}}',  # a strict tool's schema
        ):
            assert not allows(constraint, refused), (choice, refused)
        assert not allows(constraint, '<tool_call>{"name":"add", "arguments":{}', complete=True)
        assert not allows(constraint, "", complete=True)  # at least one call


def test_auto_constrains_only_the_calls_and_only_with_a_strict_tool(allows: Any) -> None:
    assert tool_use(TOOLS[:1], "auto", True, "hermes").constraint is None
    constraint = tool_use(TOOLS, "auto", True, "hermes").constraint
    assert constraint is not None
    assert allows(constraint, "Let me see.", complete=True)
    assert not allows(constraint, 'Let me see. <tool_call>{"name":"mul", "arguments":{"y": 1}}')


def test_qwen25_calls_are_forced_in_its_markup(allows: Any) -> None:
    constraint = tool_use(TOOLS, "required", True, "qwen25").constraint
    assert constraint is not None
    assert allows(constraint, '<tool_call>\n{"name":"add", "arguments":{}}\n</tool_call>', complete=True)
    assert not allows(constraint, '<tool_call>{"name"')


def test_without_a_parser_required_and_named_force_a_json_array_of_calls(allows: Any) -> None:
    required = tool_use(TOOLS, "required", True, None).constraint
    assert required is not None
    calls = [{"name": "add", "parameters": {}}, {"name": "mul", "parameters": {"x": 2}}]
    assert allows(required, json.dumps(calls), complete=True)
    assert not allows(required, "[]", complete=True) and not allows(required, "<tool_call>")
    assert not allows(required, '[{"name": "mul", "parameters": {"x": "2"}}]')  # the tool's schema
    named = tool_use(TOOLS, _named("add"), False, None).constraint  # parallel_tool_calls false: one call
    assert named is not None
    assert allows(named, json.dumps(calls[:1]), complete=True)
    assert not allows(named, json.dumps(calls[1:])) and not allows(named, json.dumps(calls[:1] * 2))
