"""Request merging's pure rules: which requests share a prompt or merge, and how a merged answer is split
into one answer per caller."""

from __future__ import annotations

import json

from art_sglang.server.request_merge import Answer, plan, split_answer
from art_sglang.server.router import Forward

CHAT = "/v1/chat/completions"


def _rollout(content: str = "play a move", **extra: object) -> dict:
    return {"model": "agent@1", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}


def _plan(body: dict, path: str = CHAT):
    return plan(Forward(path, json.dumps(body).encode(), ("agent@1",)))


def test_requests_differing_in_sampling_share_a_prompt_but_merge_only_when_equal() -> None:
    base = _plan(_rollout())
    assert base is not None and base.merge_key is not None
    longer = _plan(_rollout(max_tokens=9))
    assert longer is not None and longer.prompt_key == base.prompt_key and longer.merge_key != base.merge_key
    for own in ({"stream": True}, {"seed": 3}, {"n": 2}, {"rid": "r1"}):
        planned = _plan(_rollout(**own))
        assert planned is not None and planned.merge_key is None and planned.prompt_key == base.prompt_key
    # Fields that may change the prompt's tokens: another prompt (a session continues an earlier one).
    for other in ({"tool_choice": "none"}, {"session_id": "s"}, {"chat_template_kwargs": {"x": 1}}):
        planned = _plan(_rollout(**other))
        assert planned is not None and planned.prompt_key != base.prompt_key
    assert _plan({"model": "agent@1", "prompt": ["a", "b"]}, "/v1/completions") is None
    assert plan(Forward("/generate", b"{}", ("agent@1",))) is None


def test_a_merged_answer_is_split_into_one_answer_per_caller() -> None:
    choices = [
        {
            "index": i,
            "message": {"content": f"c{i}"},
            "token_ids": list(range(i + 1)),
            "prompt_token_ids": [7],
        }
        for i in range(3)
    ]
    usage = {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
             "prompt_tokens_details": {"cached_tokens": 9}}  # fmt: skip
    merged = Answer(200, json.dumps({"id": "x", "choices": choices, "usage": usage}).encode())
    asked = [{"return_token_ids": True}, {}, {"return_token_ids": False, "return_prompt_token_ids": True}]
    bodies = [json.loads(a.body) for a in split_answer(merged, asked)]
    assert [b["choices"][0]["message"]["content"] for b in bodies] == ["c0", "c1", "c2"]
    assert [b["usage"]["completion_tokens"] for b in bodies] == [1, 2, 3]
    assert [b["usage"]["total_tokens"] for b in bodies] == [11, 12, 13]
    assert all(b["choices"][0]["index"] == 0 and b["usage"]["prompt_tokens_details"]["cached_tokens"] == 9
               for b in bodies)  # fmt: skip
    assert "token_ids" in bodies[0]["choices"][0] and "token_ids" not in bodies[1]["choices"][0]
    assert "prompt_token_ids" not in bodies[1]["choices"][0] and "prompt_token_ids" in bodies[2]["choices"][0]
    # Without ids or logprobs (SGLang's router drops the ids) the sum is shared out evenly.
    bare = [{"index": i, "message": {"content": ""}} for i in range(3)]
    even = split_answer(Answer(200, json.dumps({"id": "y", "choices": bare, "usage": usage}).encode()), asked)
    assert [json.loads(a.body)["usage"]["completion_tokens"] for a in even] == [2, 2, 2]
    # An error, or an answer with the wrong number of choices, reaches every caller.
    refused = Answer(400, b'{"object": "error"}')
    assert split_answer(refused, asked) == [refused] * 3
    short = Answer(200, json.dumps({"id": "z", "choices": choices[:2], "usage": usage}).encode())
    assert {a.status for a in split_answer(short, asked)} == {502}
