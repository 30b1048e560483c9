"""The `logprob-json` plugin entry without SGLang: its body against the JSON of SGLang 0.5.17's own chat response,
built by stand-ins of that release's response models (their wrap serializers included) and of the token
entries `_build_chat_response` makes; and the cases it leaves to SGLang. The check against SGLang 0.5.17's own
classes needs its venv: scripts/check_logprob_json.py."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from fastapi.responses import Response
from pydantic import BaseModel, model_serializer

from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports
from art_sglang.serving.servers.sglang_site import art_sglang_logprob_json as logprob_json

PROTOCOL = "sglang.srt.entrypoints.openai.protocol"
SERVING_CHAT = "sglang.srt.entrypoints.openai.serving_chat"


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class ChatCompletionTokenLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob]


class ChatMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: (
        Literal["stop", "length", "tool_calls", "content_filter", "function_call", "abort"] | None
    ) = None
    matched_stop: int | str | None = None
    hidden_states: object | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = handler(self)
        for key in ("hidden_states", "prompt_token_ids", "token_ids", "meta_info"):
            if getattr(self, key) is None:
                data.pop(key, None)
        return data


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    metadata: dict[str, Any] | None = None
    sglext: Any = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = handler(self)
        if self.sglext is None:
            data.pop("sglext", None)
        return data


class OpenAIServingChat:
    """0.5.17's `_build_chat_response` for what the plugin entry sees of it: a token entry per
    (logprob, id, text) with the text's UTF-8 bytes, top logprobs per position, ids and meta_info on request."""

    def _build_chat_response(self, request: Any, ret: list[dict[str, Any]], created: int) -> Any:
        choices = []
        for index, item in enumerate(ret):
            meta = item["meta_info"]
            logprobs = None
            if request.logprobs:
                tops = meta.get("output_top_logprobs") or []
                content = []
                for position, (logprob, _, text) in enumerate(meta["output_token_logprobs"]):
                    top = [
                        TopLogprob(token=t, bytes=list(t.encode("utf-8")), logprob=lp)
                        for lp, _, t in (tops[position] if tops else [])
                    ]
                    entry = {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}
                    content.append(ChatCompletionTokenLogprob(**entry, top_logprobs=top))
                logprobs = ChoiceLogprobs(content=content)
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=ChatMessage(role="assistant", content=item["text"]),
                    logprobs=logprobs,
                    finish_reason=meta["finish_reason"]["type"],
                    matched_stop=meta["finish_reason"].get("matched"),
                    prompt_token_ids=item.get("prompt_token_ids") if request.return_token_ids else None,
                    token_ids=item["output_ids"] if request.return_token_ids else None,
                    meta_info=meta if request.return_meta_info else None,
                )
            )
        tokens = sum(item["meta_info"]["completion_tokens"] for item in ret)
        usage = UsageInfo(prompt_tokens=5, completion_tokens=tokens, total_tokens=5 + tokens)
        metadata = {"weight_version": ret[0]["meta_info"]["weight_version"]}
        return ChatCompletionResponse(
            id="r1", created=created, model=request.model, choices=choices, usage=usage, metadata=metadata
        )


class Newer(OpenAIServingChat):
    """0.5.23's chat route: `bytes` from the token id, which the plugin entry does not know."""

    def _build_token_logprobs_from_raw(self) -> None: ...


class OtherEntry(BaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]
    rank: int = 0


def stand_in(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


@pytest.fixture(autouse=True)
def sglang_0_5_17(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(
        sys.modules, PROTOCOL, stand_in(PROTOCOL, ChatCompletionTokenLogprob=ChatCompletionTokenLogprob)
    )
    monkeypatch.setitem(
        sys.modules, SERVING_CHAT, stand_in(SERVING_CHAT, OpenAIServingChat=OpenAIServingChat)
    )
    logprob_json._entries_json.cache_clear()
    yield
    logprob_json._entries_json.cache_clear()


def request(**changes: Any) -> types.SimpleNamespace:
    asked = {
        "model": "m",
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_meta_info": False,
    }
    return types.SimpleNamespace(**{**asked, **changes})


def answer(texts: list[Any], logprobs: list[Any], **meta: Any) -> dict[str, Any]:
    ids = [1000 + n for n in range(len(texts))]
    info = {
        "id": "r1", "finish_reason": {"type": "length"}, "weight_version": "default",
        "completion_tokens": len(texts), "output_token_logprobs": list(zip(logprobs, ids, texts, strict=True)), **meta,
    }  # fmt: skip
    return {"text": "".join(t for t in texts if isinstance(t, str)), "output_ids": ids, "meta_info": info}


ODD_TEXTS = [
    "",
    "\n",
    '\t"\\',
    "\x00\x1f\x7f",
    "é",
    "😀",
    "\ufffd",
    "\u2028",
    '"logprobs":{"content":[]}',
    "<t9>",
]
ODD_LOGPROBS = [-0.0, 0.0, -math.inf, math.nan, 5e-324, -1e-7, -123456789.123, -1 / 3, -1e300, -2.5]


def through_the_hook(chat: OpenAIServingChat, asked: Any, ret: list[dict[str, Any]]) -> Any:
    [(target, hook)] = backports.BACKPORTS["logprob-json"].hooks
    assert target == f"{SERVING_CHAT}.OpenAIServingChat._build_chat_response"
    assert hook.__qualname__ == "art_sglang_logprob_json.build_in_one_pass"
    return logprob_json.build_in_one_pass(type(chat)._build_chat_response, chat, asked, ret, 1_700_000_000)


def sglangs_body(chat: OpenAIServingChat, asked: Any, ret: list[dict[str, Any]]) -> bytes:
    return chat._build_chat_response(asked, ret, 1_700_000_000).model_dump_json(by_alias=True).encode()


@pytest.mark.parametrize(
    ("asked", "ret"),
    [
        (request(), [answer(ODD_TEXTS * 3, ODD_LOGPROBS * 3)]),
        (request(), [answer([f"<t{n}>" for n in range(1024)], [-n / 97 for n in range(1024)])]),
        (request(return_token_ids=False), [answer(["a", "b"], [-0.25, -3.0])]),
        (request(), [answer([], [])]),
        (request(), [answer(["x"], [-1.5], finish_reason={"type": "stop", "matched": "</s>"})]),
        (request(), [answer(["a"], [-0.5], weight_version='"logprobs":{"content":[]}')]),
        (request(), [answer(ODD_TEXTS, ODD_LOGPROBS), answer(["b", "c"], [-1.0, -2.0]), answer([], [])]),
    ],
)
def test_the_body_is_the_json_of_sglangs_response(asked: Any, ret: list[dict[str, Any]]) -> None:
    chat = OpenAIServingChat()
    sent = through_the_hook(chat, asked, ret)
    assert isinstance(sent, Response) and sent.media_type == "application/json"
    assert bytes(sent.body) == sglangs_body(chat, asked, ret)


@pytest.mark.parametrize(
    ("asked", "ret"),
    [
        (
            request(top_logprobs=2),
            [answer(["a"], [-0.5], output_top_logprobs=[[(-0.5, 7, "a"), (-1.0, 8, "b")]])],
        ),
        (request(return_meta_info=True), [answer(["a"], [-0.5])]),
        (request(), [answer(["a"], [-1])]),  # an int: SGLang's validation makes it -1.0
        (request(logprobs=False), [answer(["a"], [-0.5])]),
        (
            request(),
            [answer(["a"], [-0.5], weight_version={"logprobs": {"content": []}})],
        ),  # the marker twice
    ],
)
def test_other_answers_take_sglangs_path(asked: Any, ret: list[dict[str, Any]]) -> None:
    chat = OpenAIServingChat()
    sent = through_the_hook(chat, asked, ret)
    assert isinstance(sent, ChatCompletionResponse)
    assert sent.model_dump_json(by_alias=True).encode() == sglangs_body(chat, asked, ret)


def test_a_token_without_text_fails_as_in_sglang() -> None:
    ret = [answer(["a", None], [-0.5, -0.7])]
    with pytest.raises(AttributeError, match="encode"):
        sglangs_body(OpenAIServingChat(), request(), ret)
    with pytest.raises(AttributeError, match="encode"):
        through_the_hook(OpenAIServingChat(), request(), ret)


def test_a_release_that_builds_entries_otherwise_takes_sglangs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, SERVING_CHAT, stand_in(SERVING_CHAT, OpenAIServingChat=Newer))
    ret = [answer(["a"], [-0.5])]
    assert isinstance(through_the_hook(Newer(), request(), ret), ChatCompletionResponse)


def test_an_entry_model_with_other_fields_takes_sglangs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, PROTOCOL, stand_in(PROTOCOL, ChatCompletionTokenLogprob=OtherEntry))
    ret = [answer(["a"], [-0.5])]
    assert isinstance(through_the_hook(OpenAIServingChat(), request(), ret), ChatCompletionResponse)


def test_an_error_response_is_sglangs() -> None:
    class Failing(OpenAIServingChat):
        def _build_chat_response(self, request: Any, ret: list[dict[str, Any]], created: int) -> Any:
            return Response(content=b'{"error":"decode"}', status_code=400)

    sent = through_the_hook(Failing(), request(), [answer(["a"], [-0.5])])
    assert sent.status_code == 400 and bytes(sent.body) == b'{"error":"decode"}'


def test_the_entry_is_default_and_can_be_left_out() -> None:
    assert backports.BACKPORTS["logprob-json"].fixed_in is None
    assert "logprob-json" in backports.selection(None)
    assert "logprob-json" not in backports.selection(backports.without("logprob-json"))
    assert backports.selection("json-response,logprob-json") == ["json-response", "logprob-json"]


def test_its_build_makes_no_entry_models() -> None:
    """What it saves: no model per token (a 1,024-token answer made 1,024 entry models and their dumps)."""
    made: list[int] = []
    original_init = ChatCompletionTokenLogprob.__init__

    def counted(self: Any, **fields: Any) -> None:
        made.append(1)
        original_init(self, **fields)

    ret = [answer([f"<t{n}>" for n in range(1024)], [-0.5] * 1024)]
    ChatCompletionTokenLogprob.__init__ = counted  # type: ignore[method-assign]
    try:
        through_the_hook(OpenAIServingChat(), request(), ret)
    finally:
        ChatCompletionTokenLogprob.__init__ = original_init  # type: ignore[method-assign]
    assert made == []
