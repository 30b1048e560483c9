"""The `chat-convert-thread` backport, without SGLang: a stand-in with SGLang 0.5.17's `handle_request` order
(validate, log, convert inline, answer; errors answered by its handler) and the backport's two hooks wrapped
around it as SGLang's hook registry wraps AROUND hooks."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports
from art_sglang.serving.servers.sglang_site import art_sglang_chat_thread as chat_thread

CONVERT_S = 0.2  # a long prompt's tokenizing; time.sleep releases the GIL as the Rust tokenizer does


class Chat:
    """SGLang 0.5.17's `OpenAIServingBase.handle_request` in outline, its conversion a blocking call."""

    def __init__(self, log_level: int = 0) -> None:
        self.tokenizer_manager = SimpleNamespace(
            request_logger=SimpleNamespace(log_requests=log_level > 0, log_requests_level=log_level)
        )
        self.converted_on: list[str] = []
        self.logged: list[dict] = []

    def _validate_request(self, request: dict) -> str | None:
        if request["messages"] == ["unparsable tool schema"]:
            raise ValueError("bad schema")
        return None if request["messages"] else "Messages cannot be empty."

    def _convert_to_internal_request(self, request: dict, raw_request: Any = None) -> tuple[Any, dict]:
        self.converted_on.append(threading.current_thread().name)
        time.sleep(CONVERT_S)
        if request["messages"] == ["bad template"]:
            raise ValueError("template failed")
        request["converted"] = True  # SGLang's conversion changes the request (reasoning_effort, ...)
        return ("ids of", request["messages"]), request

    async def handle_request(self, request: dict, raw_request: Any) -> Any:
        try:
            error = self._validate_request(request)
            if error:
                return ("error", error)
            logger = self.tokenizer_manager.request_logger
            if logger.log_requests and logger.log_requests_level >= 2:
                self.logged.append(dict(request))
            adapted, processed = self._convert_to_internal_request(request, raw_request)
            await asyncio.sleep(0)
            return ("answer", adapted, processed is request)
        except ValueError as error:
            return ("error", str(error))


def around(original: Any, hook: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # SGLang's HookRegistry AROUND wrapper
        return hook(original, *args, **kwargs)

    return wrapper


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> type[Chat]:
    monkeypatch.setattr(Chat, "handle_request", around(Chat.handle_request, chat_thread.convert_off_loop))
    monkeypatch.setattr(
        Chat,
        "_convert_to_internal_request",
        around(Chat._convert_to_internal_request, chat_thread.take_converted),
    )
    return Chat


async def serve_with_heartbeat(chat: Chat, requests: list[dict]) -> tuple[list[Any], int]:
    """The requests handled at once beside a 10-ms heartbeat on the same loop: answers, heartbeats seen."""
    beats = 0
    done = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal beats
        while not done.is_set():
            await asyncio.sleep(0.01)
            beats += 1

    beating = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    answers = await asyncio.gather(*(chat.handle_request(request, None) for request in requests))
    done.set()
    await beating
    return answers, beats


def test_the_backport_is_0_5_23s_and_a_default() -> None:
    fixed_in = backports.BACKPORTS["chat-convert-thread"].fixed_in
    assert fixed_in is not None and backports.release("0.5.17") < fixed_in <= backports.release("0.5.23")
    assert "chat-convert-thread" in backports.selection(None)  # adopted on a GPU measurement, 2026-11-28
    assert "chat-convert-thread" in backports.selection("all")


async def test_the_loop_keeps_running_while_prompts_are_converted(hooked: type[Chat]) -> None:
    chat = hooked()
    requests = [{"messages": [f"turn {i}"]} for i in range(3)]
    answers, beats = await serve_with_heartbeat(chat, requests)
    # SGLang's answers, from the conversion of each very request (in order, on the one thread).
    assert answers == [("answer", ("ids of", [f"turn {i}"]), True) for i in range(3)]
    assert all(request["converted"] for request in requests)
    assert len(chat.converted_on) == 3 and all(
        name.startswith("art-sglang-chat-convert") for name in chat.converted_on
    )
    # 3 x 0.2 s of converting: inline the heartbeat would not beat until the last request was converted.
    assert beats >= 30


async def test_as_released_the_loop_stops_while_a_prompt_is_converted() -> None:
    answers, beats = await serve_with_heartbeat(Chat(), [{"messages": [f"turn {i}"]} for i in range(3)])
    assert [answer[0] for answer in answers] == ["answer"] * 3
    assert beats <= 2


async def test_a_conversion_error_is_answered_by_sglangs_handler(hooked: type[Chat]) -> None:
    chat = hooked()
    answers, _ = await serve_with_heartbeat(chat, [{"messages": ["bad template"]}, {"messages": ["fine"]}])
    assert answers == [("error", "template failed"), ("answer", ("ids of", ["fine"]), True)]
    assert len(chat.converted_on) == 2  # converted once each, the error not converted again inline


async def test_invalid_requests_and_logged_requests_take_sglangs_path(hooked: type[Chat]) -> None:
    chat = hooked()
    assert await chat.handle_request({"messages": []}, None) == ("error", "Messages cannot be empty.")
    raising = await chat.handle_request({"messages": ["unparsable tool schema"]}, None)
    assert raising == ("error", "bad schema")  # answered by SGLang's handler, as released
    assert chat.converted_on == []
    logging = hooked(log_level=2)
    request = {"messages": ["hi"]}
    assert await logging.handle_request(request, None) == ("answer", ("ids of", ["hi"]), True)
    # Logged as received, before the conversion changed it; converted inline.
    assert logging.logged == [{"messages": ["hi"]}]
    assert logging.converted_on == [threading.current_thread().name]
