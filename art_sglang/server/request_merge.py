"""Rollout requests that share a prompt and arrive together reach the inference server so that the prompt
is computed once.

Why: ART sends each rollout of a GRPO group as its own request, the group's requests with one identical
prompt arriving together. SGLang 0.5.17 puts a prompt into its radix cache only after the prompt's
prefill has run, so identical prompts admitted into the same (or the next) batch each compute the whole
prompt: on an H200 only 32-42 % of such prompt tokens were found cached, against vLLM's 87 %. SGLang's
own `n` does it right: it prefills the prompt once (a prefill-only copy first), then samples n choices.

So the first request of a prompt is forwarded at once, and the gateway holds the requests that follow it
with the same prompt until none came for `window` seconds (at most `MAX_WINDOWS` windows after the first),
then sends that batch:

- requests identical for the engine (same path, names, messages or prompt and sampling parameters; not
  streamed, no `n` or `seed` of their own) go as one request with `n=k`; each caller gets its own choice
  (index 0) and usage as if it had been sent alone;
- when the batch still needs more than one upstream request (mixed `max_tokens`, streams, seeds), a
  prefill-only request for the shared prompt goes first and the others are released when it returns, so
  they find the prompt cached;
- a request that shares nothing with others waits for nothing.

A group's prompt is so computed at most twice (by the first request and by the batch), not once per
rollout; the first request is not held back because ART's client sends a group's requests one to a few
milliseconds apart, and holding every request for its possible siblings would tax every multi-turn step.

A merged request is answered as a whole: SGLang 0.5.17 refuses `return_token_ids` on streamed chat
completions, and the trainer trains on exactly the sampled ids, so the merged request cannot be streamed
and a caller waits for its group's longest choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .router import Forward, error

logger = logging.getLogger(__name__)

MERGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_WINDOWS = 8  # a batch that keeps growing is sent after this many windows all the same
DEFAULT_MAX_GROUP = 64  # choices per merged request (SGLang warns about large parallel-sampling batches)

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
# Fields whose meaning a merged request would change: a request carrying one is sent on its own (it may
# still share the prompt's prefill). A seed is one: SGLang gives the choices of a seeded `n` request
# different samples, while separate requests with one seed each get the same one.
_OWN_REQUEST_FIELDS = frozenset(
    {
        "best_of",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "custom_logit_processor",
        "echo",
        "return_hidden_states",
        "return_meta_info",
        "return_routed_experts",
        "rid",
        "seed",
        "session_id",
        "session_params",
    }
)


@dataclass(frozen=True)
class Answer:
    """A response the merger made for one caller: `status` and a JSON `body`."""

    status: int
    body: bytes


Exchange = Callable[[Forward, dict[str, str]], Awaitable[Answer]]


@dataclass(frozen=True)
class Plan:
    """How one request may be combined: `prompt_key` is equal for requests with the same prompt tokens,
    `merge_key` for requests one `n=k` request can answer (None: it must be sent on its own)."""

    path: str
    payload: dict[str, Any]
    prompt_key: str
    merge_key: str | None


def plan(decision: Forward) -> Plan | None:
    """The request's plan, or None when it takes no part (another route, a query string, a batch of
    prompts, `n` not a small integer)."""
    if decision.read or decision.path not in MERGE_PATHS:
        return None
    try:
        payload = json.loads(decision.body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not _single_prompt(payload.get("prompt")):
        return None
    n = payload.get("n", 1)
    if type(n) is not int:
        return None
    prompt = {key: value for key, value in payload.items() if key not in SAMPLING_FIELDS}
    prompt_key = decision.path + _canonical(prompt)
    own = payload.get("stream") or n != 1 or any(payload.get(key) is not None for key in _OWN_REQUEST_FIELDS)
    merge_key = None if own else decision.path + _canonical(payload)
    return Plan(decision.path, payload, prompt_key, merge_key)


def _single_prompt(prompt: object) -> bool:
    # /v1/completions takes a batch of prompts as a list of strings or of token lists: not merged.
    return (
        prompt is None
        or isinstance(prompt, str)
        or (isinstance(prompt, list) and all(type(item) is int for item in prompt))
    )


def _canonical(payload: dict[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def merged_body(payload: dict[str, Any], k: int) -> bytes:
    """One request for k identical ones: `n=k`, and the sampled ids, which count each choice's tokens."""
    return json.dumps({**payload, "n": k, "return_token_ids": True}).encode()


def prefill_body(payload: dict[str, Any]) -> bytes:
    """A request that only computes the prompt (SGLang answers `max_tokens: 0` with an empty choice)."""
    prompt = {key: value for key, value in payload.items() if key not in SAMPLING_FIELDS}
    return json.dumps({**prompt, "max_tokens": 0}).encode()


def split_answer(answer: Answer, asked: list[dict[str, Any]]) -> list[Answer]:
    """The merged answer as one answer per caller (`asked`: their payloads, in choice order).

    Caller i gets choice i as choice 0, its own completion tokens, the prompt's usage (the cached tokens
    are what its choice found cached), and the sampled ids only if it asked for them. An error goes to
    every caller as it is.
    """
    if answer.status != 200:
        return [answer] * len(asked)
    try:
        merged = json.loads(answer.body)
        choices = merged["choices"]
        usage = merged["usage"]
        if len(choices) != len(asked):
            raise ValueError(f"{len(choices)} choices for {len(asked)} requests")
    except (ValueError, KeyError, TypeError) as exc:
        return [
            bad_gateway(f"the inference server's answer to a merged request could not be split: {exc!r}")
        ] * len(asked)
    counts = _completion_counts(choices, int(usage.get("completion_tokens") or 0))
    answers = []
    for i, (choice, payload) in enumerate(zip(choices, asked, strict=True)):
        own = {**choice, "index": 0}
        if not payload.get("return_token_ids"):
            own.pop("token_ids", None)
            if not payload.get("return_prompt_token_ids"):
                own.pop("prompt_token_ids", None)
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        own_usage = {
            **usage,
            "completion_tokens": counts[i],
            "total_tokens": prompt_tokens + counts[i],
            "prompt_tokens_details": copy.deepcopy(usage.get("prompt_tokens_details")),
        }
        if usage.get("reasoning_tokens"):
            own_usage["reasoning_tokens"] = None  # SGLang reports only the sum over the choices
        body = {**merged, "id": f"{merged.get('id')}-{i}", "choices": [own], "usage": own_usage}
        answers.append(Answer(200, json.dumps(body, ensure_ascii=False).encode()))
    return answers


def _completion_counts(choices: list[dict[str, Any]], total: int) -> list[int]:
    """Each choice's completion tokens: its sampled ids (or logprob entries) where every choice has
    them, else the total shared out evenly (SGLang's usage is the sum; SGLang's router drops the ids)."""
    counts = []
    for choice in choices:
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs") or {}
        entries = logprobs.get("content") if "content" in logprobs else logprobs.get("tokens")
        counts.append(
            len(ids) if isinstance(ids, list) else len(entries) if isinstance(entries, list) else None
        )
    if all(count is not None for count in counts):
        return [int(count) for count in counts]  # type: ignore[arg-type]
    share, extra = divmod(total, len(choices))
    return [share + (1 if i < extra else 0) for i in range(len(choices))]


@dataclass
class MergeCounters:
    """What merging did since the gateway started: callers answered by a merged request, upstream
    requests that took fewer, prefill-only requests sent, and prompt tokens not computed again."""

    requests_merged: int = 0
    upstream_requests_saved: int = 0
    prefill_requests: int = 0
    prefill_tokens_saved: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class _Member:
    plan: Plan
    decision: Forward
    headers: dict[str, str]
    future: asyncio.Future[Answer | None]
    left: bool = False
    on_leave: Callable[[], None] | None = None


@dataclass
class _Batch:
    key: str
    opened: float
    members: list[_Member] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class RequestMerger:
    """Batches requests by prompt and sends each batch as few requests as it can (see the module's text).

    Runs on the gateway's event loop; `exchange` sends one request upstream and reads its whole answer.
    """

    def __init__(self, exchange: Exchange, *, window: float, max_group: int = DEFAULT_MAX_GROUP):
        if window <= 0:
            raise ValueError(f"the merge window must be positive, got {window}")
        self._exchange = exchange
        self._window = window
        self._max_group = max_group
        self._open: dict[str, _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = MergeCounters()

    async def submit(self, plan: Plan, decision: Forward, headers: dict[str, str]) -> Answer | None:
        """The caller's answer once its batch was sent, or None when the caller should send its own
        request now: the first request of a prompt, and one that could not be merged."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(plan.prompt_key)
        if batch is None:
            # The first request of a prompt goes at once, so a request that shares nothing waits for
            # nothing; those that follow it within the window are sent together.
            batch = self._open[plan.prompt_key] = _Batch(plan.prompt_key, loop.time())
            batch.timer = loop.call_at(batch.opened + self._window, self._close, batch)
            return None
        member = _Member(plan, decision, headers, loop.create_future())
        batch.members.append(member)
        if batch.timer is not None:
            batch.timer.cancel()
        close_at = min(loop.time() + self._window, batch.opened + MAX_WINDOWS * self._window)
        batch.timer = loop.call_at(close_at, self._close, batch)
        try:
            # Shielded: one caller leaving must not cancel the answer its siblings wait for.
            return await asyncio.shield(member.future)
        except asyncio.CancelledError:
            member.left = True
            if member.on_leave is not None:
                member.on_leave()
            raise

    def _close(self, batch: _Batch) -> None:
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]
        members = [m for m in batch.members if not m.left]
        units: dict[object, list[_Member]] = {}
        for member in members:
            key = member.plan.merge_key if member.plan.merge_key is not None else id(member)
            units.setdefault(key, []).append(member)
        groups = [
            unit[start : start + self._max_group]
            for unit in units.values()
            for start in range(0, len(unit), self._max_group)
        ]
        if not groups:
            return
        if len(groups) == 1:
            self._start(groups[0])
        else:
            self._spawn(self._prefill_then_start(groups))

    def _start(self, group: list[_Member]) -> None:
        if len(group) == 1:
            _resolve(group[0], None)  # the caller sends its own request
        else:
            self._spawn(self._send_merged(group))

    async def _prefill_then_start(self, groups: list[list[_Member]]) -> None:
        first = groups[0][0]
        prefill = replace(first.decision, body=prefill_body(first.plan.payload))
        try:
            answer = await self._exchange(prefill, first.headers)
            if answer.status == 200:
                self.counters.prefill_requests += 1
                prompt_tokens = int(json.loads(answer.body)["usage"]["prompt_tokens"])
                self.counters.prefill_tokens_saved += (len(groups) - 1) * prompt_tokens
            else:
                # The requests themselves will get (and report) whatever made the server refuse it.
                logger.debug("prefill-only request answered %d: %s", answer.status, answer.body[:200])
        except (ValueError, KeyError, TypeError):
            logger.debug("prefill-only answer without usage", exc_info=True)
        finally:
            for group in groups:
                self._start(group)

    async def _send_merged(self, group: list[_Member]) -> None:
        first = group[0]
        merged = replace(first.decision, body=merged_body(first.plan.payload, len(group)))
        send = asyncio.ensure_future(self._exchange(merged, first.headers))

        def leave() -> None:
            # Cancelled (closing its connection, so the server stops) only once every caller left.
            if all(member.left for member in group):
                send.cancel()

        for member in group:
            member.on_leave = leave
        leave()
        try:
            answer = await send
        except asyncio.CancelledError:
            if all(member.left for member in group):
                return
            for member in group:  # the gateway is closing
                _resolve(member, bad_gateway("the gateway closed before the server answered"))
            raise
        except Exception as exc:
            logger.exception("merged request failed")
            answer = bad_gateway(f"the merged request failed: {exc!r}")
        for member, own in zip(group, split_answer(answer, [m.plan.payload for m in group]), strict=True):
            _resolve(member, own)
        if answer.status == 200:
            self.counters.requests_merged += len(group)
            self.counters.upstream_requests_saved += len(group) - 1
            with contextlib.suppress(ValueError, KeyError, TypeError):
                prompt_tokens = int(json.loads(answer.body)["usage"]["prompt_tokens"])
                self.counters.prefill_tokens_saved += (len(group) - 1) * prompt_tokens

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("merged request failed", exc_info=task.exception())


def bad_gateway(message: str) -> Answer:
    """The 502 answer (OpenAI's error shape) for a request the server did not answer."""
    return Answer(502, json.dumps(error(message, "bad_gateway")).encode())


def _resolve(member: _Member, answer: Answer | None) -> None:
    if not member.future.done():
        member.future.set_result(answer)
