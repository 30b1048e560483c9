"""Rollout requests that share a prompt and arrive together reach the inference server so that the prompt
is computed at most twice, not once per request.

Why: ART sends each rollout of a GRPO group as its own request, the group's requests with one identical
prompt arriving together. SGLang 0.5.17 puts a prompt into its radix cache only after the prompt's
prefill has run, so identical prompts admitted into the same (or the next) batch each compute the whole
prompt: on an H200 only 32-42 % of such prompt tokens were found cached, against vLLM's 87 %.

So the first request of a prompt is forwarded at once, and the requests that follow it with the same
prompt (any sampling parameters) are held until none came for `window` seconds (at most `MAX_WINDOWS`
windows after the first). Then one prefill-only request (`max_tokens: 0`) computes the prompt, and the held
requests are forwarded as they came once it returns, each finding the prompt cached. A single follower is
forwarded without one; a request that shares its prompt with none waits for nothing.

Why not one request with `n=k` for identical requests, which SGLang prefills once: SGLang 0.5.17 counts
an `n` request's use of an adapter once but releases it once per choice and once more for its own
prefill-only copy, so an adapter that served an `n>1` request can never be unloaded again (seen on an H200:
`/unload_lora_adapter` hung). The backend unloads old steps' adapters after every step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .gateway_rules import Forward, error

logger = logging.getLogger(__name__)

SHARED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_WINDOWS = 8  # requests that keep coming are released after this many windows all the same

# Fields that steer sampling or the answer's form, never the prompt's tokens: requests differing only in
# these still share their prompt. Any other field counts as shaping the prompt (a field missing here only
# forgoes sharing, never shares wrongly). `tool_choice` is not here: "none" drops the tools from the prompt.
SAMPLING_FIELDS = frozenset(
    {
        "frequency_penalty",
        "ignore_eos",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "min_p",
        "min_tokens",
        "n",
        "no_stop_trim",
        "presence_penalty",
        "priority",
        "repetition_penalty",
        "return_cached_tokens_details",
        "return_prompt_token_ids",
        "return_token_ids",
        "rid",
        "seed",
        "skip_special_tokens",
        "stop",
        "stop_regex",
        "stop_token_ids",
        "stream",
        "stream_options",
        "temperature",
        "top_k",
        "top_logprobs",
        "top_p",
        "user",
    }
)


@dataclass(frozen=True)
class Answer:
    """A whole response: `status` and a JSON `body`."""

    status: int
    body: bytes


Exchange = Callable[[Forward, dict[str, str]], Awaitable[Answer]]
_Held = tuple[Forward, dict[str, str], "asyncio.Future[None]"]  # a request, its headers, its turn


def prompt_key(decision: Forward) -> str | None:
    """Equal for requests whose prompts are the same tokens; None for a request that takes no part
    (another route, a query string, a batch of prompts)."""
    payload = decision.payload
    if decision.read or decision.path not in SHARED_PATHS or payload is None:
        return None
    if not _single_prompt(payload.get("prompt")):
        return None
    return decision.path + json.dumps(
        _prompt_part(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def _single_prompt(prompt: object) -> bool:
    # /v1/completions takes a batch of prompts as a list of strings or of token lists: not shared.
    return (
        prompt is None
        or isinstance(prompt, str)
        or (isinstance(prompt, list) and all(type(item) is int for item in prompt))
    )


def _prompt_part(payload: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key not in SAMPLING_FIELDS}


def prefill_body(payload: Mapping[str, Any]) -> bytes:
    """A request that only computes the prompt (SGLang answers `max_tokens: 0` with an empty choice)."""
    return json.dumps({**_prompt_part(payload), "max_tokens": 0}).encode()


def bad_gateway(message: str) -> Answer:
    """The 502 answer (OpenAI's error shape) for a request the server did not answer."""
    return Answer(502, json.dumps(error(message, "bad_gateway")).encode())


@dataclass
class PrefillCounters:
    """What prefill sharing did since the gateway started: requests held for a shared prefill,
    prefill-only requests sent, and prompt tokens the held requests found computed."""

    requests_held: int = 0
    prefill_requests: int = 0
    prefill_tokens_saved: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class _Batch:
    opened: float
    waiting: list[_Held] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class PrefillSharing:
    """Holds requests that follow another with their prompt until one prefill-only request computed it
    (see the module's text). Runs on the gateway's event loop; `exchange` sends one request upstream."""

    def __init__(self, exchange: Exchange, *, window: float):
        if window <= 0:
            raise ValueError(f"the prefill-sharing window must be positive, got {window}")
        self._exchange = exchange
        self._window = window
        self._open: dict[str, _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = PrefillCounters()

    async def wait_turn(self, key: str, decision: Forward, headers: dict[str, str]) -> None:
        """Return when the request should be forwarded: at once for the first request of its prompt, else
        once the prompt was computed for the requests held with it."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(loop.time())
            batch.timer = loop.call_at(batch.opened + self._window, self._close, key, batch)
            return
        turn: asyncio.Future[None] = loop.create_future()
        batch.waiting.append((decision, headers, turn))
        if batch.timer is not None:
            batch.timer.cancel()
        close_at = min(loop.time() + self._window, batch.opened + MAX_WINDOWS * self._window)
        batch.timer = loop.call_at(close_at, self._close, key, batch)
        await turn

    def _close(self, key: str, batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        waiting = [entry for entry in batch.waiting if not entry[2].done()]  # a caller may have left
        if len(waiting) < 2:
            _release(waiting)
            return
        task = asyncio.ensure_future(self._prefill_then_release(waiting))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefill_then_release(self, waiting: list[_Held]) -> None:
        decision, headers, _ = waiting[0]
        try:
            assert decision.payload is not None  # prompt_key() admitted only parsed requests
            answer = await self._exchange(replace(decision, body=prefill_body(decision.payload)), headers)
            if answer.status == 200:
                prompt_tokens = int(json.loads(answer.body)["usage"]["prompt_tokens"])
                self.counters.requests_held += len(waiting)
                self.counters.prefill_requests += 1
                self.counters.prefill_tokens_saved += (len(waiting) - 1) * prompt_tokens
            else:
                # The requests themselves will get (and report) whatever made the server refuse it.
                logger.debug("prefill-only request answered %d: %s", answer.status, answer.body[:200])
        except (ValueError, KeyError, TypeError):
            logger.debug("prefill-only answer without usage", exc_info=True)
        finally:
            _release(waiting)


def _release(waiting: list[_Held]) -> None:
    for _, _, turn in waiting:
        if not turn.done():
            turn.set_result(None)
