"""A wave of GRPO groups sent all at once, each request on its own new connection (as the bench's client and
ART's send them, the gateway closing every connection), while the gateway's loop is busy: every prompt is
computed once, by its one prefill-only request, before any of its group's requests.

The gateway listened with aiohttp's backlog of 128: connections beyond it were dropped by the kernel and
resent by the client 1 s later, so a group whose first request got in and the rest did not was split: the
first went alone after the lead, the rest started a prefill-only request 1 s later, and the prompt was
computed twice (issue 39: 4 of 16 waves on an H200; reproduced on CPU with `nstat`'s ListenOverflows). And a
first request whose lead ran out while the loop was busy still waits for a partner taken in meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from backend_helpers import StandIn

from art_sglang.serving.gateway import app as gateway_app
from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.gateway.rules import Forward

GROUPS = 32
GROUP_SIZE = 8
STALL_S = 0.5  # how long the stall request keeps the gateway's loop busy
STALL = "stall"  # the system prompt of the stall request

Post = Callable[[str], Awaitable[None]]


@contextlib.asynccontextmanager
async def _gateway(
    monkeypatch: pytest.MonkeyPatch, lead: float, arrivals: dict[str, list[int]]
) -> AsyncIterator[tuple[AdapterGateway, Post]]:
    """A gateway with prefill sharing in front of a stand-in server that records the max_tokens of each
    request by system prompt, and `post(system)`: a chat request on a new connection. The request with the
    system prompt STALL keeps the gateway's loop busy for STALL_S, as a burst's own work (or a thread
    waiting for the GIL) does."""

    async def chat(request: web.Request) -> web.Response:
        payload = await request.json()
        arrivals[payload["messages"][0]["content"]].append(payload["max_tokens"])
        await asyncio.sleep(0.05)
        usage = {"prompt_tokens": 40, "completion_tokens": payload["max_tokens"]}
        choice = {"index": 0, "message": {"role": "assistant", "content": "1,1"}, "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": usage})

    key = gateway_app.prompt_key

    def slow_key(decision: Forward) -> str | None:
        if decision.payload is not None and decision.payload["messages"][0]["content"] == STALL:
            time.sleep(STALL_S)
        return key(decision)

    monkeypatch.setattr(gateway_app, "prompt_key", slow_key)
    upstream = StandIn([web.post("/v1/chat/completions", chat)])
    await upstream.start()
    gateway = AdapterGateway(upstream.url, share_lead=lead)
    gateway.start()
    gateway.set_served(["agent@1"], ["base"])
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:

            async def post(system: str) -> None:
                body = {"model": "agent@1", "max_tokens": 4, "temperature": 1.0,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "move?"}]}  # fmt: skip
                async with http.post(f"{gateway.base_url}/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()

            yield gateway, post
    finally:
        gateway.close()
        await upstream.close()


async def test_a_wave_of_groups_computes_each_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    arrivals: dict[str, list[int]] = defaultdict(list)
    prompts = [f"group {g}. " + "Play tic-tac-toe and answer with one move. " * 100 for g in range(GROUPS)]
    async with _gateway(monkeypatch, 0.003, arrivals) as (gateway, post):
        stall = asyncio.create_task(post(STALL))
        await asyncio.sleep(0.1)  # the gateway's loop is now busy with the stall request
        await asyncio.gather(*(post(p) for p in prompts for _ in range(GROUP_SIZE)))  # all connect now
        await stall
    # Each prompt: one prefill-only request, before any of its requests; then the group's eight.
    computed_twice = [prompt[:9] for prompt in prompts if arrivals[prompt][0] != 0]
    assert computed_twice == []
    assert all(arrivals[prompt] == [0] + [4] * GROUP_SIZE for prompt in prompts)
    counters = gateway.prefill_counters()
    assert counters["prefill_requests"] == GROUPS and counters["requests_alone"] == 1  # the stall request


async def test_a_partner_that_came_while_the_loop_was_busy_past_the_lead_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first request's lead runs out while the gateway's loop is busy (another request's work, or the
    gateway thread waiting for the GIL its process's other threads hold): its partner, whose connection
    came in the meantime, still finds it waiting, and the prompt is computed once."""
    arrivals: dict[str, list[int]] = defaultdict(list)
    async with _gateway(monkeypatch, 0.05, arrivals) as (gateway, post):
        first = asyncio.create_task(post("group 0."))
        await asyncio.sleep(0.01)  # the first waits for company (the lead is 50 ms)
        stall = asyncio.create_task(post(STALL))  # the loop is busy from now until past the lead
        await asyncio.sleep(0.1)
        await asyncio.gather(first, stall, post("group 0."))  # the partner, sent while the loop is busy
    # One prefill-only request, then both requests of the prompt: not the first alone before it.
    assert arrivals["group 0."] == [0, 4, 4]
    counters = gateway.prefill_counters()
    assert counters["requests_held"] == 2 and counters["requests_alone"] == 1  # the stall request
