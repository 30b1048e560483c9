"""Rollout requests that share a prompt and arrive together reach the inference server so that the prompt
is computed once, not once per request.

Why: ART sends each rollout of a GRPO group as its own request, the group's requests with one identical
prompt arriving together. SGLang 0.5.17 puts a prompt into its radix cache only after the prompt's
prefill has run, so identical prompts admitted into the same (or the next) batch each compute the whole
prompt: on an H200 only 32-42 % of such prompt tokens were found cached, against vLLM's 87 %.

So the first request of a prompt waits up to `lead` seconds for another with the same prompt (any
sampling parameters). If none comes it goes alone; a request that shares nothing is delayed by `lead`, and
`GRACE_TURNS` turns of the event loop, at most. Once a second one comes, one prefill-only request
(`max_tokens: 0`) computes the prompt, and every request of the prompt that is waiting or comes while it
runs goes as it came once it returns, finding the prompt cached; those that come later (within
`PROMPT_MEMORY_S` of the first) go at once. With `lead` 0 the first request never waits, and the prompt is
computed at most twice (by it and by the prefill-only one).

Why the turns: the lead is measured on the clock, but the loop may get to the deadline late (busy with a
wave's other requests, or its thread waiting for the GIL while the process's other threads run, in turns of
5 ms by default, longer than the lead). A partner whose bytes came in meanwhile is taken in the same loop
turn as the expired deadline, but reaches `wait_turn` 3 turns later (accepted, read, routed: aiohttp 3.14,
Python 3.11), while the deadline wakes the first in one: without the turns the first went alone and the
group's prompt was computed twice. Turns, not time: a loop that runs on time spends microseconds on them, and
a lone request of a multi-turn rollout amid steady traffic is not held longer (as it would be by a wait
extended while requests keep arriving). Issue 39 saw groups split on an H200 (a wave held 123 of its 128
requests, 3.8 % of its prompt tokens uncached); `requests_alone` counts the first requests that went alone.

Why not one request with `n=k` for identical requests, which SGLang prefills once: SGLang 0.5.17 counts
an `n` request's use of an adapter once per choice but releases it once per choice and once more for its
own prefill-only copy, so an adapter that served an `n>1` request can never be unloaded again (seen on an
H200: `/unload_lora_adapter` hung). The backend unloads old steps' adapters after every step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .rules import Forward, error

logger = logging.getLogger(__name__)

SHARED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# A request with the prompt of one that came this long before it follows that one (a GRPO group's requests
# arrive within milliseconds of each other); later, the prompt is no longer taken to be in the cache.
PROMPT_MEMORY_S = 2.0
# Loop turns the first request of a prompt still waits once its lead ran out (see the module's text).
GRACE_TURNS = 8

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
    """A request that computes the prompt and no token (SGLang answers `max_tokens: 0` with an empty
    choice)."""
    return json.dumps({**_prompt_part(payload), "max_tokens": 0}).encode()


def bad_gateway(message: str) -> Answer:
    """The 502 answer (OpenAI's error shape) for a request the server did not answer."""
    return Answer(502, json.dumps(error(message, "bad_gateway")).encode())


@dataclass
class PrefillCounters:
    """What prefill sharing did since the gateway started: requests held for a shared prefill,
    prefill-only requests answered, prompt tokens the held requests found computed, prefill-only
    requests that failed (their prompts' requests went on without a shared prefill), and first requests
    that waited their lead in vain and went alone (a later one of their prompt computes it again)."""

    requests_held: int = 0
    prefill_requests: int = 0
    prefill_tokens_saved: int = 0
    prefill_failures: int = 0
    requests_alone: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class _Prompt:
    """One prompt's requests: `company` is set when a second one comes (the first waits on it);
    `computed` is the prefill-only request, once one was sent."""

    created: float
    company: asyncio.Future[None]
    computed: asyncio.Task[None] | None = None
    waiting: int = 0  # requests that wait for `computed`


class PrefillSharing:
    """Has the requests of a prompt that arrive together wait for one prefill-only request of it (see the
    module's text). Runs on the gateway's event loop; `exchange` sends one request upstream (with
    replicas, to the replica the prompt's other requests go to)."""

    def __init__(self, exchange: Exchange, *, lead: float):
        if lead < 0:
            raise ValueError(f"the prefill-sharing lead must not be negative, got {lead}")
        self._exchange = exchange
        self._lead = lead
        self._prompts: dict[str, _Prompt] = {}  # oldest first
        self._tasks: set[asyncio.Task[None]] = set()  # prefill-only requests under way
        self.counters = PrefillCounters()

    async def wait_turn(self, key: str, decision: Forward, headers: dict[str, str]) -> None:
        """Return when the request should be forwarded."""
        loop = asyncio.get_running_loop()
        self._forget_before(loop.time() - PROMPT_MEMORY_S)
        prompt = self._prompts.get(key)
        if prompt is None:
            prompt = self._prompts[key] = _Prompt(loop.time(), loop.create_future())
            if self._lead == 0:
                return
            if not await self._company_within_lead(prompt):
                self.counters.requests_alone += 1
                return  # alone so far: a later request of this prompt starts the prefill-only one
        elif prompt.computed is None:
            prompt.computed = asyncio.ensure_future(self._prefill(prompt, decision, headers))
            self._tasks.add(prompt.computed)
            prompt.computed.add_done_callback(self._tasks.discard)
            if not prompt.company.done():
                prompt.company.set_result(None)
        assert prompt.computed is not None
        if not prompt.computed.done():
            prompt.waiting += 1
            # wait(), not await: a caller that leaves does not cancel the others' prefill, and the
            # requests go on (and meet any error themselves) whatever became of it.
            await asyncio.wait({prompt.computed})

    async def _company_within_lead(self, prompt: _Prompt) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(prompt.company), self._lead)
            return True
        except asyncio.TimeoutError:
            pass
        # The loop may have run late past the deadline: a partner it took in by then reaches wait_turn only
        # a few loop turns later (accepted, read, parsed, routed), while the timeout woke this one in one.
        for _ in range(GRACE_TURNS):
            if prompt.company.done():
                return True
            await asyncio.sleep(0)  # one loop turn, which also polls the sockets
        return prompt.company.done()

    def _forget_before(self, horizon: float) -> None:
        while self._prompts:
            key, prompt = next(iter(self._prompts.items()))
            if prompt.created >= horizon:
                return
            del self._prompts[key]

    async def _prefill(self, prompt: _Prompt, decision: Forward, headers: dict[str, str]) -> None:
        try:
            assert decision.payload is not None  # prompt_key() admitted only parsed requests
            body = prefill_body(decision.payload)
            answer = await self._exchange(replace(decision, body=body), headers)
            if answer.status == 200:
                prompt_tokens = int(json.loads(answer.body)["usage"]["prompt_tokens"])
                self.counters.requests_held += prompt.waiting
                self.counters.prefill_requests += 1
                self.counters.prefill_tokens_saved += max(prompt.waiting - 1, 0) * prompt_tokens
            else:
                # The requests themselves will get (and report) whatever made the server refuse it; a
                # refusal of every prefill-only request (a server that takes no such request) is shown
                # once and counted in the step metrics.
                self.counters.prefill_failures += 1
                log = logger.warning if self.counters.prefill_failures == 1 else logger.debug
                log("a prefill-only request was answered %d: %s", answer.status, answer.body[:300])
        except (ValueError, KeyError, TypeError):
            logger.debug("prefill-only answer without usage", exc_info=True)
        except Exception:
            self.counters.prefill_failures += 1
            logger.exception("the prefill-only request failed; its prompt's requests go on without it")
