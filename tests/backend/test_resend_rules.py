"""The gateway's continuation of a rollout an update aborted (serving/gateway/resend.py), without sockets:
which requests are continued, the /generate body that continues one, and the one choice stitched from the
aborted answer and its continuations, with the weight version of every run of tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from art_sglang.serving.gateway.resend import VERSIONS_FIELD, continuation, with_versions
from art_sglang.serving.gateway.rules import CHAT_PATH, Forward, Served, route
from art_sglang.serving.gateway.stream_resend import continued, sse_events

SERVED = Served(frozenset({"agent@1"}), frozenset({"base"}), {"m@3": "base"})


def _route(model: str, **extra: object) -> Forward:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()
    decision = route("POST", CHAT_PATH, body, SERVED)
    assert isinstance(decision, Forward)
    return decision


def test_unconstrained_requests_on_merged_weights_are_continued() -> None:
    plain = _route("m@3", logprobs=True)
    assert (plain.aliased, plain.versioned, plain.resend) == (True, True, True)
    assert plain.annotated  # read whole, so its choices can carry their versions
    streamed = _route("m@3", stream=True)
    assert (streamed.aliased, streamed.versioned, streamed.resend) == (True, False, True)
    several = _route("m@3", stream=True, n=2)  # one continuation per stream
    assert (several.aliased, several.resend) == (True, False)
    constrained = _route("m@3", regex="[ab]+")
    assert (constrained.versioned, constrained.resend) == (True, False)
    tools = _route("m@3", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert (tools.versioned, tools.resend) == (True, False)  # the parser would start over on the rest
    without_ids = _route("m@3", return_token_ids=False)  # nothing to continue from
    assert (without_ids.versioned, without_ids.resend) == (True, False)
    adapter = _route("agent@1")
    assert (adapter.aliased, adapter.versioned, adapter.resend) == (False, False, False)


def _aborted(tokens: int, *, logprobs: bool = True) -> dict[str, Any]:
    ids = list(range(100, 100 + tokens))
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ab" * tokens},
                "logprobs": {"content": [{"token": "ab", "logprob": -0.5, "top_logprobs": []}] * tokens}
                if logprobs
                else None,
                "finish_reason": "abort",
                "matched_stop": None,
                "prompt_token_ids": [1, 2, 3],
                "token_ids": ids,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens},
        "metadata": {"weight_version": "m@3"},
    }


def _part(tokens: int, version: str, finish: dict[str, Any]) -> dict[str, Any]:
    return {
        "text": "cd" * tokens,
        "output_ids": list(range(500, 500 + tokens)),
        "meta_info": {
            "finish_reason": finish,
            "weight_version": version,
            "output_token_logprobs": [[-1.25, 500 + i, "cd"] for i in range(tokens)],
            "output_top_logprobs": [[[-1.25, 500 + i, "cd"]] for i in range(tokens)],
        },
    }


def test_the_continuation_asks_for_the_rest_on_the_sampled_ids() -> None:
    payload = {"model": "m@3", "max_tokens": 10, "temperature": 0.7, "top_k": 5, "stop": ["x"], "logprobs": True,
               "top_logprobs": 2, "seed": 3}  # fmt: skip
    choice = _aborted(4)["choices"][0]
    body = continuation(CHAT_PATH, payload, choice)
    assert body == {
        "input_ids": [1, 2, 3, 100, 101, 102, 103],
        "sampling_params": {"temperature": 0.7, "top_k": 5, "stop": ["x"], "max_new_tokens": 6},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    assert continuation(CHAT_PATH, {**payload, "max_tokens": 4}, choice) is None  # budget spent
    unbounded = continuation(CHAT_PATH, {"model": "m@3"}, choice)
    assert unbounded is not None and unbounded["sampling_params"] == {"max_new_tokens": None}
    text = continuation("/v1/completions", {"model": "m@3", "logprobs": 1}, choice)
    assert text is not None and text["sampling_params"]["max_new_tokens"] == 12  # 16 when unset
    assert text["return_logprob"] and text["top_logprobs_num"] == 1


async def test_an_aborted_choice_is_stitched_with_its_continuations_and_their_versions() -> None:
    parts = [
        _part(3, "m@4", {"type": "abort", "message": "aborted"}),  # a second update cut it again
        _part(2, "m@5", {"type": "stop", "matched": 7}),
    ]
    posted: list[dict[str, Any]] = []

    async def post(body: dict[str, Any]) -> tuple[int, bytes]:
        posted.append(body)
        return 200, json.dumps(parts[len(posted) - 1]).encode()

    payload = {"model": "m@3", "max_tokens": 20, "logprobs": True, "top_logprobs": 1}
    body = await with_versions(CHAT_PATH, payload, json.dumps(_aborted(4)).encode(), post)
    answer = json.loads(body)
    [choice] = answer["choices"]
    assert choice[VERSIONS_FIELD] == [
        {"version": "m@3", "tokens": 4},
        {"version": "m@4", "tokens": 3},
        {"version": "m@5", "tokens": 2},
    ]
    assert choice["token_ids"] == [100, 101, 102, 103, 500, 501, 502, 500, 501]
    assert choice["message"]["content"] == "ab" * 4 + "cd" * 3 + "cd" * 2
    entries = choice["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == [-0.5] * 4 + [-1.25] * 5  # each as its version sampled it
    assert entries[-1] == {"token": "cd", "bytes": [99, 100], "logprob": -1.25,
                           "top_logprobs": [{"token": "cd", "bytes": [99, 100], "logprob": -1.25}]}  # fmt: skip
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", 7)
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    assert answer["metadata"]["weight_version"] == "m@5"
    assert [p["input_ids"][3:] for p in posted] == [[100, 101, 102, 103], [100, 101, 102, 103, 500, 501, 502]]
    assert [p["sampling_params"]["max_new_tokens"] for p in posted] == [16, 13]


@pytest.mark.parametrize("status", [200, 503])
async def test_without_a_continuation_the_choice_keeps_one_span(status: int) -> None:
    async def refused(body: dict[str, Any]) -> tuple[int, bytes]:
        return 503, b'{"error": "down"}'

    finished = _aborted(4)
    finished["choices"][0]["finish_reason"] = "length" if status == 200 else "abort"
    post = refused if status == 503 else None
    answer = json.loads(await with_versions(CHAT_PATH, {}, json.dumps(finished).encode(), post))
    [choice] = answer["choices"]
    assert choice[VERSIONS_FIELD] == [{"version": "m@3", "tokens": 4}]
    assert choice["finish_reason"] == finished["choices"][0]["finish_reason"]
    assert len(choice["token_ids"]) == 4


def _chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": content}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _usage(tokens: int) -> dict[str, Any]:
    return {
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens},
    }


async def _events(*events: Any) -> AsyncIterator[Any]:
    for event in events:
        yield event


@pytest.mark.parametrize("usage", [True, False])
async def test_an_aborted_stream_goes_on_from_its_text_as_one_stream(usage: bool) -> None:
    first = _events(
        _chunk(role=True), _chunk("He"), _chunk("llo"), _chunk(finish="abort"), _usage(2), "[DONE]"
    )
    rest = _events(_chunk(role=True), _chunk(" you"), _chunk(finish="length"), _usage(1), "[DONE]")
    posted: list[dict[str, Any]] = []

    serving = ["m@3"]  # what the gateway serves: m@4 from the push on

    async def post(body: dict[str, Any]) -> AsyncIterator[Any]:
        posted.append(body)
        serving[0] = "m@4"
        return rest

    payload: dict[str, Any] = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}  # fmt: skip
    sent = [event async for event in continued(payload, first, lambda: serving[0], post)]
    parsed = [event async for event in sse_events(_events(*sent))]
    assert posted == [{**payload, "stream_options": {"include_usage": True}, "continue_final_message": True,
                       "messages": [*payload["messages"], {"role": "assistant", "content": "Hello"}], "max_tokens": 1}]  # fmt: skip
    chunks = [e for e in parsed if isinstance(e, dict) and e.get("choices")]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "He", "llo", " you", None]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"  # never the abort
    assert chunks[-1]["choices"][0][VERSIONS_FIELD] == [
        {"version": "m@3", "tokens": 2},
        {"version": "m@4", "tokens": 1},
    ]
    usages = [e["usage"] for e in parsed if isinstance(e, dict) and "usage" in e]
    assert usages == ([{"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}] if usage else [])
    assert parsed[-1] == "[DONE]"


def test_answer_json_reads_what_python_servers_write_and_writes_strict_json() -> None:
    from art_sglang.serving.gateway import json_body

    written = json.dumps({"logprob": float("-inf"), "x": [1, "é"]}).encode()  # `-Infinity`: not strict JSON
    assert json_body.loads(written) == {"logprob": float("-inf"), "x": [1, "é"]}
    assert json.loads(json_body.dumps({"logprob": float("-inf")})) == {"logprob": None}
    with pytest.raises(ValueError):
        json_body.loads(b"not json")
