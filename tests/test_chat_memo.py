"""The `chat-template-memo` backport's parts that need no SGLang: its choice, its key and its bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports
from art_sglang.serving.servers.sglang_site import art_sglang_chat_memo as memo

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
INPUTS: dict[str, Any] = {
    "tokenizer": 1,
    "chat_template": "{{ messages }}",
    "content_format": "string",
    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": None}],
    "tools": [TOOL],
    "chat_template_kwargs": {"enable_thinking": False},
    "reasoning_effort": None,
    "continue_final_message": False,
    "add_generation_prompt": None,
    "add_special_tokens": None,
}


def test_the_memo_is_chosen_by_default_by_name_and_by_all() -> None:
    assert backports.BACKPORTS["chat-template-memo"].fixed_in is None
    assert "chat-template-memo" in backports.selection("all")
    assert "chat-template-memo" in backports.selection(None)
    assert "chat-template-memo" not in backports.selection("json-response")
    assert backports.selection("json-response,chat-template-memo") == ["json-response", "chat-template-memo"]


def test_equal_inputs_give_equal_keys() -> None:
    copied = {**INPUTS, "messages": [dict(m) for m in INPUTS["messages"]], "tools": [dict(TOOL)]}
    assert memo.memo_key(copied) == memo.memo_key(INPUTS) is not None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tokenizer", 2),
        ("chat_template", "{{ messages }} "),
        ("content_format", "openai"),
        ("messages", [{"role": "system", "content": "s"}, {"role": "user", "content": "hi!", "name": None}]),
        ("messages", [{"role": "user", "content": "hi", "name": None}]),
        ("messages", [{"content": "s", "role": "system"}, {"role": "user", "content": "hi", "name": None}]),
        ("messages", [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": "x"}]),
        ("messages", [{"role": "system", "content": "s"}, {"role": "user", "content": [{"text": "hi"}]}]),
        ("tools", None),
        ("tools", [TOOL, TOOL]),
        ("tools", (TOOL,)),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("chat_template_kwargs", {"enable_thinking": 0}),
        ("chat_template_kwargs", {"enable_thinking": "False"}),
        ("chat_template_kwargs", None),
        ("reasoning_effort", "low"),
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("add_special_tokens", True),
    ],
)
def test_any_changed_input_changes_the_key(name: str, value: Any) -> None:
    assert memo.memo_key({**INPUTS, name: value}) != memo.memo_key(INPUTS)


@pytest.mark.parametrize("value", [{1: "a"}, object(), {"a": {"b", "c"}}, b"bytes"])
def test_inputs_that_are_not_plain_data_are_not_memoised(value: Any) -> None:
    assert memo.memo_key({**INPUTS, "chat_template_kwargs": value}) is None


def test_the_memo_keeps_the_most_recently_used_entries_up_to_its_size() -> None:
    kept = memo.PromptMemo(size=3)
    for key in "abc":
        kept.put(key, (ord(key),), None)
    assert kept.get("a") == ((97,), None)  # a is now the most recent
    kept.put("d", (100,), None)
    assert len(kept) == 3
    assert kept.get("b") is None
    assert [kept.get(key) is not None for key in "acd"] == [True, True, True]


@dataclass
class Result:  # the fields of SGLang's MessageProcessingResult the hook reads or sets
    prompt_ids: list[int]
    stop: Any
    prompt: str = ""
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    modalities: list[str] = field(default_factory=list)


class Message:
    def __init__(self, content: str) -> None:
        self.content = content

    def model_dump(self) -> dict[str, Any]:
        return {"role": "user", "content": self.content}


class Request:
    def __init__(self, content: str, stop: Any = None) -> None:
        self.messages = [Message(content)]
        self.stop = stop
        self.chat_template_kwargs = None
        self.reasoning_effort = None
        self.continue_final_message = False


class Chat:
    chat_encoding_spec = None

    def __init__(self) -> None:
        self.tokenizer_manager = type(
            "Manager", (), {"tokenizer": type("Tok", (), {"chat_template": "t"})()}
        )()
        self.template_manager = type("Templates", (), {"jinja_template_content_format": "string"})()


def test_the_hook_tokenizes_a_prompt_once_and_hands_out_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memo, "_MEMO", memo.PromptMemo())
    calls: list[str] = []

    def original(chat: Chat, request: Request, tools: Any, is_multimodal: bool) -> Result:
        calls.append(request.messages[0].content)
        return Result(prompt_ids=[ord(c) for c in request.messages[0].content], stop=request.stop)

    chat = Chat()
    first = memo.memoised_jinja_template(original, chat, Request("ab", stop=["x"]), None, False)
    first.prompt_ids.append(0)  # what the caller does to its result must not reach the memo
    first.modalities.append("image")
    second = memo.memoised_jinja_template(original, chat, Request("ab", stop=["y"]), None, False)
    other = memo.memoised_jinja_template(original, chat, Request("abc"), None, False)
    assert calls == ["ab", "abc"]
    assert (second.prompt_ids, second.stop, second.modalities) == ([97, 98], ["y"], [])
    assert other.prompt_ids == [97, 98, 99]
    memo.memoised_jinja_template(original, chat, Request("ab"), None, True)  # multimodal: SGLang's own path
    assert calls == ["ab", "abc", "ab"]


def test_custom_encoders_and_results_with_media_are_not_memoised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memo, "_MEMO", memo.PromptMemo())
    calls: list[str] = []

    def original(chat: Chat, request: Request, tools: Any, is_multimodal: bool) -> Result:
        calls.append(request.messages[0].content)
        media = ["img"] if request.messages[0].content == "media" else None
        return Result(prompt_ids=[1], stop=None, image_data=media)

    adapted = Chat()
    adapted._encoding_adapter = object()  # type: ignore[attr-defined]  # 0.5.23's custom encoders
    for chat, content in ((adapted, "a"), (Chat(), "media")):
        for _ in range(2):
            memo.memoised_jinja_template(original, chat, Request(content), None, False)
    assert calls == ["a", "a", "media", "media"]
    assert len(memo._MEMO) == 0
