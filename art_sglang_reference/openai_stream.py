"""SGLang's OpenAI event streams for /v1/chat/completions and /v1/completions (`stream: true`): the
chunks per choice, tool calls parsed out of the streamed text, usage if asked, and [DONE]."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from . import tool_calls
from .engine import ReferenceEngine
from .generation import GenerationRequest, GenerationResult
from .http_common import Delta, engine_error_body, note_results, sse, stream_generations
from .openai_format import chat_logprob, completion_logprobs, finish_fields, usage
from .schemas import ChatCompletionRequest, CompletionRequest


def chat_stream(
    engine: ReferenceEngine,
    body: ChatCompletionRequest,
    requests: list[GenerationRequest],
    request: Request,
    parsing: tool_calls.ToolParsing | None,
) -> AsyncIterator[str]:
    splitters = {index: parsing.splitter() for index in range(len(requests))} if parsing is not None else {}

    def choice(
        index: int, delta: dict[str, Any], logprobs: Any = None, finish: Any = None, matched: Any = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"reasoning_content": None, **delta},
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }

    def piece(item: Delta) -> dict[str, Any] | None:
        logprobs = None
        if body.logprobs and item.logprob is not None:
            logprobs = {"content": [chat_logprob(engine, item.logprob)]}
        text = splitters[item.index].push(item.text) if parsing is not None else item.text
        if not text and logprobs is None:
            return None
        return choice(item.index, {"content": text} if text else {}, logprobs)

    def last(index: int, result: GenerationResult) -> list[dict[str, Any]]:
        finish, matched = finish_fields(result)
        chunks = []
        if parsing is not None:
            rest, calls = splitters[index].finish(parsing)
            if rest:
                chunks.append(choice(index, {"content": rest}))
            for position, call in enumerate(calls):
                head = call.as_openai(position)
                head["function"] = {"name": call.name, "arguments": ""}
                chunks.append(choice(index, {"tool_calls": [head]}))
                tail = {"index": position, "function": {"arguments": call.arguments}}
                chunks.append(choice(index, {"tool_calls": [tail]}))
            if calls and finish == "stop":
                finish, matched = "tool_calls", None
        return [*chunks, choice(index, {}, finish=finish, matched=matched)]

    return _stream(
        engine,
        body,
        requests,
        request,
        kind="chat.completion.chunk",
        first=lambda index: choice(index, {"role": "assistant", "content": ""}),
        piece=piece,
        last=last,
    )


async def _stream(
    engine: ReferenceEngine,
    body: ChatCompletionRequest | CompletionRequest,
    requests: list[GenerationRequest],
    request: Request,
    *,
    kind: str,
    first: Callable[[int], dict[str, Any]] | None,
    piece: Callable[[Delta], dict[str, Any] | None],
    last: Callable[[int, GenerationResult], list[dict[str, Any]]],
) -> AsyncIterator[str]:
    """SGLang's OpenAI event stream: per choice an optional `first` chunk, one per streamed `piece` (None:
    nothing to send), and the `last` ones (tool calls held back, then the finish reason); then usage if asked, and [DONE]. An engine
    failure mid-stream is sent as an error event."""
    rid, created = uuid.uuid4().hex, int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        head = {"id": rid, "object": kind, "created": created, "model": body.model}
        return sse({**head, "choices": choices, **extra})

    results: list[GenerationResult] = []
    opened: set[int] = set()
    try:
        async for item in stream_generations(engine, requests):
            if first is not None and item.index not in opened:
                opened.add(item.index)
                yield chunk([first(item.index)])
            if isinstance(item, Delta):
                choice = piece(item)
                if choice is not None:
                    yield chunk([choice])
                continue
            results.append(item.result)
            for closing in last(item.index, item.result):
                yield chunk([closing])
        if body.include_usage:
            yield chunk([], usage=usage(results, body.n, engine.args.enable_cache_report))
    except Exception as exc:
        yield sse({"error": engine_error_body(exc)})
    note_results(request, results)
    yield "data: [DONE]\n\n"


def completion_stream(
    engine: ReferenceEngine, body: CompletionRequest, requests: list[GenerationRequest], request: Request
) -> AsyncIterator[str]:
    def piece(item: Delta) -> dict[str, Any] | None:
        logprobs = None
        if body.logprobs is not None and item.logprob is not None:
            logprobs = completion_logprobs(engine, [item.logprob])
        if not item.text and logprobs is None:
            return None
        return {
            "index": item.index,
            "text": item.text,
            "logprobs": logprobs,
            "finish_reason": None,
            "matched_stop": None,
        }

    def last(index: int, result: GenerationResult) -> list[dict[str, Any]]:
        finish, matched = finish_fields(result)
        return [
            {"index": index, "text": "", "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        ]

    return _stream(
        engine, body, requests, request, kind="text_completion", first=None, piece=piece, last=last
    )
