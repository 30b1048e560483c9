"""The gateway's streamed answers: relayed as the server sends them (`relay`), or as a stream of events
continued across merged-weight updates (`relay_events`, stream_resend.py). Every response closes its
connection (app.py says why); a server that dies mid-stream, or a backend being closed, cuts the client's
stream off, so a truncated answer is never taken for a whole one."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from .prefill_sharing import Answer
from .rules import NOT_FORWARDED, error

CLOSED = error(
    "the backend was closed while this request ran: the server was stopped before it finished",
    "backend_closed",
)


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    closing: threading.Event,
    refused: Callable[[Answer], None],
) -> web.StreamResponse:
    """Stream the server's response to the client (a refusal, small, is read whole and told to `refused`)."""
    async with upstream:
        if upstream.status == 400:
            answer = Answer(upstream.status, await upstream.read())
            refused(answer)
            return whole(answer)
        if upstream.status == 200 and closing.is_set():
            return whole(Answer(503, json.dumps(CLOSED).encode()))
        response = web.StreamResponse(status=upstream.status)
        for key, value in upstream.headers.items():
            if key.lower() not in NOT_FORWARDED:
                response.headers.add(key, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        return await _stream(request, response, upstream.content.iter_any(), closing)


async def relay_events(
    request: web.Request, events: AsyncIterator[bytes], closing: threading.Event
) -> web.StreamResponse:
    """Stream `events` (server-sent events, made by the gateway) to the client."""
    response = web.StreamResponse(status=200)
    response.content_type = "text/event-stream"
    return await _stream(request, response, events, closing)


async def _stream(
    request: web.Request, response: web.StreamResponse, chunks: AsyncIterator[bytes], closing: threading.Event
) -> web.StreamResponse:
    response.force_close()
    await response.prepare(request)
    try:
        async for chunk in chunks:
            if closing.is_set():
                raise aiohttp.ClientPayloadError("the backend was closed while the response streamed")
            await response.write(chunk)
    except aiohttp.ClientError:
        # The server died (or is being stopped) mid-response: the client sees a truncated response and an
        # error.
        if request.transport is not None:
            request.transport.close()
        return response
    # A client that closed once it had every event (ART's does after `[DONE]`) lost nothing.
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


def whole(answer: Answer) -> web.Response:
    response = web.Response(status=answer.status, body=answer.body, content_type="application/json")
    response.force_close()  # see the module's text
    return response
