"""The gateway's constraint rule without sockets: what a constrained request is forwarded as, what is
refused with a 400 (malformed constraints, custom logit processors, streamed constrained rollouts), and the
constraint each returned choice carries."""

from __future__ import annotations

import json

import pytest

from art_sglang.constraints import CONSTRAINT_FIELD, MASK_BIAS, Grammar, SamplingConstraint
from art_sglang.serving.gateway.rules import Forward, Refuse, Served, route, with_constraint

SERVED = Served(frozenset({"agent@1"}), frozenset({"base"}))


def _post(path: str = "/v1/chat/completions", model: str = "agent@1", **extra: object) -> Forward | Refuse:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return route("POST", path, json.dumps(body).encode(), SERVED)


def _forwarded(decision: Forward | Refuse) -> tuple[dict, SamplingConstraint | None]:
    assert isinstance(decision, Forward), decision
    return json.loads(decision.body), decision.constraint


def test_an_allowed_set_is_forwarded_as_sglang_logit_bias() -> None:
    body, constraint = _forwarded(_post(allowed_token_ids=[9, 3, 3], logit_bias={"3": -2}))
    # SGLang has no allowed-set field (it would ignore it): +100 on each allowed id, the user's bias added.
    assert "allowed_token_ids" not in body
    assert body["logit_bias"] == {"3": MASK_BIAS - 2, "9": MASK_BIAS}
    assert constraint == SamplingConstraint(logit_bias=((3, -2.0),), allowed_token_ids=(3, 9))


@pytest.mark.parametrize(
    ("extra", "grammar"),
    [
        ({"regex": "[0-9]+"}, Grammar(kind="regex", source="[0-9]+")),
        ({"ebnf": 'root ::= "a"'}, Grammar(kind="ebnf", source='root ::= "a"')),
        ({"json_schema": '{"type": "integer"}'}, Grammar(kind="json_schema", source='{"type": "integer"}')),
        (
            {"response_format": {"type": "json_object"}},
            Grammar(kind="json_schema", source='{"type": "object"}'),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer"}},
                }
            },
            Grammar(kind="json_schema", source='{"type": "integer"}'),
        ),
    ],
)
def test_grammars_are_forwarded_as_sent_and_carried(extra: dict, grammar: Grammar) -> None:
    body, constraint = _forwarded(_post(**extra))
    assert {key: body[key] for key in extra} == extra and "logit_bias" not in body
    assert constraint == SamplingConstraint(grammar=grammar)


def test_unconstrained_and_text_format_requests_carry_nothing() -> None:
    assert _forwarded(_post())[1] is None
    assert _forwarded(_post(response_format={"type": "text"}))[1] is None


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"logit_bias": [1, 2]}, "logit_bias", "must be an object"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "from -100 to 100"),
        ({"logit_bias": {"5": True}}, "logit_bias", "from -100 to 100"),
        ({"logit_bias": {"²": 1}}, "logit_bias", "token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "non-negative"),
        ({"allowed_token_ids": [1], "logit_bias": {"2": 1}}, "logit_bias", "not in allowed_token_ids"),
        ({"regex": ""}, "regex", "non-empty string"),
        ({"regex": "a", "json_schema": "{}"}, "json_schema", "only one of"),
        ({"json_schema": "{nope"}, "json_schema", "not valid JSON"),
        ({"json_schema": {"type": "integer"}}, "json_schema", "as SGLang takes it"),
        ({"structural_tag": "{}"}, "structural_tag", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "must be 'text'"),
        ({"custom_logit_processor": "{}"}, "custom_logit_processor", "arbitrary Python code"),
    ],
)
def test_malformed_constraints_are_a_400_naming_the_field(extra: dict, param: str, message: str) -> None:
    refused = _post(**extra)
    assert isinstance(refused, Refuse) and refused.status == 400
    assert refused.payload["error"]["param"] == param and message in refused.payload["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_custom_logit_processor_is_refused_on_every_inference_route(path: str) -> None:
    refused = _post(path, custom_logit_processor='{"callable": "80"}')
    assert (
        isinstance(refused, Refuse)
        and refused.status == 400
        and "dill" in refused.payload["error"]["message"]
    )


def test_a_streamed_constrained_rollout_on_a_trained_model_is_refused() -> None:
    refused = _post(stream=True, regex="a+")
    assert (
        isinstance(refused, Refuse)
        and refused.status == 400
        and refused.payload["error"]["param"] == "stream"
    )
    # On the base model nothing is trained, so it streams, rewritten as ever, with nothing to annotate.
    body, carried = _forwarded(_post(model="base", stream=True, allowed_token_ids=[4]))
    assert body["logit_bias"] == {"4": MASK_BIAS} and carried is None


def test_each_returned_choice_carries_the_constraint() -> None:
    constraint = SamplingConstraint(allowed_token_ids=(4, 7))
    body = json.dumps({"choices": [{"index": 0}, {"index": 1}], "usage": {}}).encode()
    choices = json.loads(with_constraint(body, constraint))["choices"]
    carried = [SamplingConstraint.model_validate(c[CONSTRAINT_FIELD]) for c in choices]
    assert carried == [constraint, constraint]
    assert with_constraint(b"not json", constraint) == b"not json"


def _tool(name: str) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }


TOOLS = [_tool("add"), _tool("mul")]


def _tools_post(served: Served = SERVED, **extra: object) -> Forward | Refuse:
    body = {"model": "agent@1", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}
    return route("POST", "/v1/chat/completions", json.dumps(body).encode(), served)


def test_a_forced_tool_call_carries_sglangs_structural_tag_with_the_rest_of_the_constraint() -> None:
    decision = _tools_post(tool_choice="required", allowed_token_ids=[4, 7])
    assert isinstance(decision, Forward) and decision.constraint is not None and decision.annotated
    grammar = decision.constraint.grammar
    assert grammar is not None and grammar.kind == "structural_tag"
    tag = json.loads(grammar.source)
    assert tag["at_least_one"] is True and tag["triggers"] == ["<tool_call>"]
    assert [s["begin"] for s in tag["structures"]] == [
        '<tool_call>{"name":"add", "arguments":',
        '<tool_call>{"name":"mul", "arguments":',
    ]
    assert decision.constraint.allowed_token_ids == (4, 7) and decision.template_tools is None
    # "auto" without a strict tool: SGLang does not constrain, nothing to carry.
    auto = _tools_post(tool_choice="auto")
    assert isinstance(auto, Forward) and not auto.annotated


def test_a_requests_own_grammar_wins_over_the_tool_constraint_as_in_sglang() -> None:
    decision = _tools_post(tool_choice="required", regex="a+")
    assert isinstance(decision, Forward) and decision.constraint is not None
    assert decision.constraint.grammar == Grammar(kind="regex", source="a+")


def test_without_a_parser_the_json_array_schema_is_carried() -> None:
    served = Served(SERVED.adapters, SERVED.base_ids, tool_call_parser=None)
    decision = _tools_post(served, tool_choice="required")
    assert isinstance(decision, Forward) and decision.constraint is not None
    grammar = decision.constraint.grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.source)["type"] == "array"


def test_the_tools_the_template_rendered_travel_when_they_are_not_the_requests() -> None:
    named = _tools_post(tool_choice={"type": "function", "function": {"name": "mul"}})
    assert isinstance(named, Forward) and named.template_tools == [TOOLS[1]]
    assert named.constraint is not None and named.constraint.grammar is not None  # any tool may be called
    none = _tools_post(tool_choice="none")
    assert isinstance(none, Forward) and none.template_tools == [] and none.constraint is None
    body = json.dumps({"choices": [{"index": 0}]}).encode()
    [choice] = json.loads(with_constraint(body, None, []))["choices"]
    assert choice == {"index": 0, "art_template_tools": []}


def test_a_tool_constraint_the_trainer_cannot_reproduce_or_receive_is_refused_on_a_trained_model() -> None:
    unknown = Served(SERVED.adapters, SERVED.base_ids, tool_call_parser="llama3")
    refused = _tools_post(unknown, tool_choice="required")
    assert (
        isinstance(refused, Refuse)
        and refused.status == 400
        and "llama3" in refused.payload["error"]["message"]
    )
    streamed = _tools_post(tool_choice="none", stream=True)
    assert isinstance(streamed, Refuse) and streamed.payload["error"]["param"] == "stream"
    # A tool_choice SGLang itself refuses (an unknown tool) is forwarded for its own 400.
    missing = _tools_post(tool_choice={"type": "function", "function": {"name": "div"}})
    assert isinstance(missing, Forward) and not missing.annotated
