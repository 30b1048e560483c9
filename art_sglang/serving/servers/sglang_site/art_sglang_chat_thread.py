"""The `chat-convert-thread` backport (art_sglang_backports.py): a chat request's conversion (chat template,
tokenization of the whole prompt, sampling parameters) runs on a worker thread instead of the HTTP process's
event loop, as SGLang 0.5.23's `OpenAIServingBase.handle_request` does (`loop.run_in_executor`) and vLLM 0.24's
renderer does (`make_async` on a one-thread pool).

SGLang 0.5.17 converts each request inline: ~3-4 ms of tokenizing for a multi-turn conversation of ~1,300
tokens (CPU), during which that process neither sends finished answers nor reads the next requests, so the
turns of a multi-turn wave reach the scheduler one by one. The Rust tokenizer releases the GIL while it
encodes, so on a thread the loop goes on meanwhile.

Two hooks share the work: `convert_off_loop` (AROUND `handle_request`) converts a valid request on the thread
and holds the outcome for that request in a context variable while SGLang's own `handle_request` runs, and
`take_converted` (AROUND `_convert_to_internal_request`) hands SGLang that outcome (its result, or its error
raised where SGLang's conversion would have raised it) instead of converting again. Anything else converts
inline: a request `_validate_request` rejects (SGLang answers its error before converting), and every request
where the request log's level 2 logs requests before their conversion (the conversion changes them),
and a request whose validation raises.
One thread, as vLLM's: every conversion in arrival order, and the tokenizer's state (truncation, padding) is
never changed by two conversions at once. Imports nothing of art_sglang and no SGLang.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, NamedTuple


class Converted(NamedTuple):
    """What the thread made of `request`: SGLang's (adapted, processed) pair, or the error it raised."""

    request: Any
    result: Any
    error: BaseException | None


_HELD: contextvars.ContextVar[Converted | None] = contextvars.ContextVar("art_sglang_converted", default=None)


@cache
def _thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-sglang-chat-convert")


def _convert(chat: Any, request: Any, raw_request: Any) -> Converted:
    try:
        return Converted(request, chat._convert_to_internal_request(request, raw_request), None)
    except Exception as error:  # handed to SGLang's handler, which answers it as it answers any other
        return Converted(request, None, error)


def _logs_before_conversion(chat: Any) -> bool:
    logger = chat.tokenizer_manager.request_logger
    return bool(logger.log_requests) and getattr(logger, "log_requests_level", 0) >= 2


async def convert_off_loop(original: Callable[..., Any], chat: Any, request: Any, raw_request: Any) -> Any:
    """AROUND `OpenAIServingChat.handle_request(request, raw_request)`."""
    try:
        inline = bool(chat._validate_request(request)) or _logs_before_conversion(chat)
    except Exception:  # raised again inside SGLang's handler, which answers it
        inline = True
    if inline:
        return await original(chat, request, raw_request)
    converted = await asyncio.get_running_loop().run_in_executor(
        _thread(), _convert, chat, request, raw_request
    )
    held = _HELD.set(converted)
    try:
        return await original(chat, request, raw_request)
    finally:
        _HELD.reset(held)


def take_converted(original: Callable[..., Any], chat: Any, request: Any, raw_request: Any = None) -> Any:
    """AROUND `OpenAIServingChat._convert_to_internal_request(request, raw_request)`: the outcome the thread
    holds for this very request, else SGLang's own conversion (on the thread itself, and inline)."""
    held = _HELD.get()
    if held is None or held.request is not request:
        return original(chat, request, raw_request)
    _HELD.set(None)  # one use: a second conversion of the request converts again
    if held.error is not None:
        raise held.error
    return held.result
