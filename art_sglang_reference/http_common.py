"""Pieces shared by the native and OpenAI routes: SGLang's error body, running generations off the event
loop, and streaming their text as it is produced."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .engine import EngineReleasedError, ReferenceEngine
from .generation import GenerationRequest, GenerationResult, TokenLogprob

logger = logging.getLogger(__name__)


def error_body(message: str, status: int = 400, error_type: str = "BadRequestError") -> dict[str, Any]:
    """SGLang's error body: {"object": "error", "message", "type", "param", "code"}."""
    return {"object": "error", "message": message, "type": error_type, "param": None, "code": status}


def error_response(message: str, status: int = 400, error_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, status, error_type), status_code=status)


def engine_error_body(exc: Exception) -> dict[str, Any]:
    """The error SGLang gives for the same situation as an engine exception (code = HTTP status)."""
    if isinstance(exc, EngineReleasedError):
        return error_body(str(exc), 503, "ServiceUnavailableError")
    if isinstance(exc, ValueError):  # bad input: sampling parameters, lengths, adapters, prompts
        return error_body(str(exc))
    logger.exception("request failed")
    return error_body(f"Internal error: {exc!r}", 500, "InternalServerError")


def engine_error_response(exc: Exception) -> JSONResponse:
    body = engine_error_body(exc)
    return JSONResponse(body, status_code=body["code"])


def note(request: Request, **fields: Any) -> None:
    """Add key=value fields to this request's log line."""
    extra = getattr(request.state, "log_fields", None)
    if extra is None:
        extra = request.state.log_fields = {}
    extra.update(fields)


def note_results(request: Request, results: list[GenerationResult]) -> None:
    if not results:
        return
    adapter = results[0].adapter
    note(
        request,
        adapter=adapter.name if adapter else "base",
        prompt=len(results[0].prompt_ids),
        n=len(results),
        completion=sum(len(r.output_ids) for r in results),
        cached=results[0].cached_tokens,
    )


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def run_generations(
    engine: ReferenceEngine, requests: list[GenerationRequest]
) -> list[GenerationResult]:
    """Run admitted requests one after another in a worker thread (the engine serialises the model
    anyway); their adapter counts are given back when they end, however they end."""
    try:
        await asyncio.to_thread(prefill_once, engine, requests)
        return [await asyncio.to_thread(engine.generate, r) for r in requests]
    finally:
        engine.adapter_uses.give_back([r.adapter_name for r in requests], shares_prompt(requests))


def shares_prompt(requests: list[GenerationRequest]) -> bool:
    """Choices of a request with `n > 1` (as serving/choice_count.py reads it), which SGLang prefills once
    with a prefill-only copy."""
    return any(r.parallel for r in requests)


def prefill_once(engine: ReferenceEngine, requests: list[GenerationRequest]) -> None:
    """SGLang's `n`: a prefill-only copy computes the shared prompt first, so every choice (the first one
    too) finds the prompt cached and reports it so."""
    if shares_prompt(requests):
        first = requests[0]
        sampling = replace(first.sampling, max_new_tokens=0, stop=list(first.sampling.stop))
        engine.generate(GenerationRequest(first.prompt_ids, sampling, adapter_name=first.adapter_name))


_background: set[asyncio.Task[None]] = set()


@dataclass
class Delta:
    index: int
    text: str
    logprob: TokenLogprob | None


@dataclass
class Finished:
    index: int
    result: GenerationResult


async def stream_generations(
    engine: ReferenceEngine, requests: list[GenerationRequest]
) -> AsyncIterator[Delta | Finished]:
    """Yield text pieces as the worker thread produces them, then each request's result. Closing the
    iterator early (client gone) aborts the generation in flight."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Delta | Finished | BaseException | None] = asyncio.Queue()
    abort = threading.Event()

    def push(item: Delta | Finished | BaseException | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    for index, request in enumerate(requests):
        request.abort = abort
        request.on_delta = lambda text, lp, i=index: push(Delta(i, text, lp))

    async def produce() -> None:
        try:
            await asyncio.to_thread(prefill_once, engine, requests)
            for index, request in enumerate(requests):
                push(Finished(index, await asyncio.to_thread(engine.generate, request)))
        except Exception as exc:  # handed to the consumer, which reports it in the stream
            push(exc)
        finally:
            engine.adapter_uses.give_back([r.adapter_name for r in requests], shares_prompt(requests))
        push(None)

    task = asyncio.create_task(produce())
    _background.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_background.discard)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        abort.set()
