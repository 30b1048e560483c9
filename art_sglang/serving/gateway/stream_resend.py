"""A streamed chat rollout on merged weights that an update aborted, continued (resend.py does it for whole
answers): SGLang 0.5.17's chat streams carry no token ids (`return_token_ids` is refused with `stream`),
so the continuation is the same chat request with the text streamed so far as the assistant's turn to go
on from (`continue_final_message`, which SGLang encodes after the prompt's ids) and the rest of the token
budget. The client sees one stream: the continuation's chunks follow the first's (its opening role chunk
left out), the aborted finish is never sent, and the final chunk's choice carries `art_weight_versions`.
The tokens of each run are counted from the stream's usage, which the gateway asks for upstream and passes
on (summed) only where the client asked for it.

A streamed choice is trained from its text and logprobs (no ids), as any streamed choice is; the
continuation's context is the text re-encoded, which may cut the tokens sampled before it differently."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from .resend import MAX_RESENDS, VERSIONS_FIELD, add_span, budget_left
from .rules import CHAT_PATH

# One continuation: the chat body -> its events, once it may be sent.
StreamPost = Callable[[dict[str, Any]], Awaitable[AsyncIterator[Any]]]
DONE = "[DONE]"


def with_usage(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The request as sent upstream: with usage at the end of its stream (the run's token count)."""
    return {**payload, "stream_options": {**(payload.get("stream_options") or {}), "include_usage": True}}


def chat_continuation(payload: Mapping[str, Any], text: str, sampled: int) -> dict[str, Any] | None:
    """The chat request that goes on from `text` (`sampled` tokens so far); None when the budget is spent."""
    remaining = budget_left(CHAT_PATH, payload, sampled)
    if remaining is not None and remaining <= 0:
        return None
    body = with_usage(payload)
    body["messages"] = [*payload["messages"], {"role": "assistant", "content": text}]
    body["continue_final_message"] = True
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = remaining
    return body


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The `data:` payloads of an event stream as they arrive: parsed JSON, or "[DONE]"."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.decode().splitlines():
                if line.startswith("data:"):
                    data = line[len("data:") :].strip()
                    yield DONE if data == DONE else json.loads(data)


def sse(payload: Any) -> bytes:
    return f"data: {payload if payload == DONE else json.dumps(payload)}\n\n".encode()


async def continued(
    payload: Mapping[str, Any],
    events: AsyncIterator[Any],
    serving: Callable[[], str | None],
    post: StreamPost,
) -> AsyncIterator[bytes]:
    """The client's stream from the upstream `events`, each run an update aborted continued by `post` (up
    to `MAX_RESENDS` times). A run's version is `serving()` when its first chunk comes: a stream's headers
    come before a paused server generates, its first chunk only once it does."""
    text, sampled, spans = "", 0, []
    usage: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    for attempt in range(MAX_RESENDS + 1):
        ended, tokens, version = None, 0, None
        async for event in events:
            if event == DONE:
                break
            version = version or serving()
            choices = event.get("choices") if isinstance(event, dict) else None
            if not choices:  # the usage chunk, or an error event
                if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                    tokens = event["usage"].get("completion_tokens") or 0
                    usage = _summed(usage, event)
                    continue
                yield sse(event)
                continue
            delta = choices[0].get("delta") or {}
            if attempt > 0 and delta.get("role") and not delta.get("content"):
                continue  # the continuation's opening chunk: the client has had one
            text += delta.get("content") or ""
            if choices[0].get("finish_reason") is not None:
                ended = event  # sent last, with the versions
                continue
            yield sse(event)
        sampled += tokens
        spans = add_span(spans, version, tokens)
        final = ended or final  # a continuation that failed leaves the abort to be sent
        if ended is None or ended["choices"][0].get("finish_reason") != "abort" or attempt == MAX_RESENDS:
            break
        body = chat_continuation(payload, text, sampled)
        if body is None:
            break
        events = await post(body)
    if final is not None:
        final["choices"][0][VERSIONS_FIELD] = spans
        yield sse(final)
    if usage is not None and (payload.get("stream_options") or {}).get("include_usage"):
        yield sse(usage)
    yield sse(DONE)


def _summed(total: dict[str, Any] | None, event: dict[str, Any]) -> dict[str, Any]:
    """The usage chunk of the whole stream: the first run's prompt, every run's completion tokens."""
    if total is None:
        return event
    tokens = event["usage"].get("completion_tokens") or 0
    usage = {**total["usage"], "completion_tokens": total["usage"].get("completion_tokens", 0) + tokens}
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
    return {**total, "usage": usage}
