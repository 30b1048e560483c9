"""Which replica the gateway sends a request to: a GRPO group's requests together on one, a conversation
back on its replica unless it carries more than its share, new ones on the least loaded, replicas the
router finds failing or that refuse connections passed over. The rule alone, then through a gateway in
front of two recording HTTP replicas and a stand-in for the router's worker list."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from backend_helpers import StandIn

from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.gateway.balancer import AFFINITY_PREFIX, UNREACHABLE_S, ReplicaChoice, affinity_key
from art_sglang.serving.gateway.prefill_sharing import PROMPT_MEMORY_S
from art_sglang.serving.gateway.rules import Forward
from art_sglang.serving.gateway.upstream import HEALTH_POLL_S

A, B, C = "http://a:1", "http://b:1", "http://c:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _choice(*urls: str) -> tuple[ReplicaChoice, Clock]:
    clock = Clock()
    return ReplicaChoice(urls, clock=clock), clock


def test_a_groups_requests_follow_the_first_whatever_the_load() -> None:
    choice, clock = _choice(A, B)
    first = choice.pick("group", "conversation")
    assert [choice.pick("group", "conversation") for _ in range(7)] == [first] * 7
    assert choice.load(first) == 8
    # Another group goes to the idle replica, and its own requests follow it.
    other = choice.pick("group 2", "conversation 2")
    assert other != first and choice.pick("group 2", "conversation 2") == other
    # Once the group is over and forgotten, its prompt is placed like any other request.
    for _ in range(8):
        choice.done(first)
    clock.now += PROMPT_MEMORY_S + 0.1
    assert choice.pick("group 2", None) == first  # the least loaded now


def test_a_conversation_returns_to_its_replica_unless_it_carries_more_than_its_share() -> None:
    choice, _ = _choice(A, B)
    home = choice.pick(None, "conversation")
    choice.done(home)
    assert choice.pick(None, "conversation") == home  # next turn, both idle
    choice.done(home)
    # Its replica carries 3 requests of another conversation (placed there while it alone was healthy),
    # the other none: with the next turn it would carry 4 of 4 in flight, more than 1.5 times its half,
    # so the turn moves (and the conversation stays on its new replica).
    choice.set_healthy([home])
    assert [choice.pick(None, "another") for _ in range(3)] == [home] * 3
    choice.set_healthy(None)
    moved = choice.pick(None, "conversation")
    assert moved != home
    choice.done(moved)
    assert choice.pick(None, "conversation") == moved


def test_new_requests_go_to_the_least_loaded_and_ties_alternate() -> None:
    choice, _ = _choice(A, B, C)
    picked = [choice.pick(None, None) for _ in range(3)]
    assert sorted(picked) == [A, B, C]
    choice.done(B)
    assert choice.pick(None, "new") == B
    assert _one_by_one(_choice(A, B)[0], 2) == {A, B}


def _one_by_one(choice: ReplicaChoice, requests: int) -> set[str | None]:
    """The replicas `requests` requests sent one after the other went to."""
    picked = set()
    for _ in range(requests):
        picked.add(url := choice.pick(None, None))
        if url is not None:
            choice.done(url)
    return picked


def test_replicas_the_router_finds_failing_are_passed_over() -> None:
    choice, _ = _choice(A, B)
    choice.set_healthy([B])
    assert _one_by_one(choice, 4) == {B}
    choice.set_healthy(None)  # the router does not answer: every routed replica counts
    assert _one_by_one(choice, 4) == {A, B}
    choice.set_healthy([])  # none healthy: trying them beats refusing every request
    assert _one_by_one(choice, 4) == {A, B}
    # A group or a conversation on a failing replica moves.
    choice.set_healthy(None)
    home = choice.pick("group", "conversation")
    choice.set_healthy([url for url in (A, B) if url != home])
    assert choice.pick("group", "conversation") != home


def test_a_replica_that_refused_a_connection_is_passed_over_for_a_while() -> None:
    choice, clock = _choice(A, B)
    choice.unreachable(A)
    assert _one_by_one(choice, 4) == {B}
    assert choice.pick(None, None, avoid={B}) is None
    clock.now += UNREACHABLE_S + 0.1
    assert _one_by_one(choice, 4) == {A, B}
    choice.unreachable(A)
    choice.unreachable(B)
    assert choice.pick(None, None) in (A, B)  # every one refused: tried anyway
    choice.set_routed([])
    assert choice.pick(None, None) is None


def _forward(path: str, payload: dict, read: bool = False) -> Forward:
    return Forward(path, json.dumps(payload).encode(), payload=payload, read=read)


def test_the_turns_of_a_conversation_share_its_affinity() -> None:
    system = {"role": "system", "content": "You play a game."}
    first = [system, {"role": "user", "content": "Scenario 7"}]
    later = [*first, {"role": "assistant", "content": "move"}, {"role": "tool", "content": "ok"}]
    chat = "/v1/chat/completions"
    key = affinity_key(_forward(chat, {"model": "agent@1", "messages": first, "temperature": 1.0}))
    assert key is not None
    assert affinity_key(_forward(chat, {"model": "agent@1", "messages": later})) == key
    other_scenario = [system, {"role": "user", "content": "Scenario 8"}]
    assert affinity_key(_forward(chat, {"model": "agent@1", "messages": other_scenario})) != key
    assert affinity_key(_forward(chat, {"model": "agent@2", "messages": first})) != key
    # A text prompt is known by its start; a batch of prompts and a read by nothing.
    text = "x" * AFFINITY_PREFIX
    longer = affinity_key(_forward("/v1/completions", {"model": "m", "prompt": text + "more"}))
    assert affinity_key(_forward("/v1/completions", {"model": "m", "prompt": text})) == longer
    ids = affinity_key(_forward("/generate", {"input_ids": [1, 2, 3], "sampling_params": {}}))
    assert ids is not None and ids != affinity_key(_forward("/generate", {"input_ids": [1, 2, 4]}))
    assert affinity_key(_forward("/v1/completions", {"model": "m", "prompt": ["a", "b"]})) is None
    assert affinity_key(Forward("/v1/models", b"", read=True)) is None


def _replica(name: str, served: Counter[str]) -> StandIn:
    """A replica answering every POST with its name, counting them in `served`."""

    async def answer(_: web.Request) -> web.Response:
        served[name] += 1
        return web.json_response({"replica": name})

    return StandIn([web.post("/{path:.*}", answer)])


def _router(healthy: dict[str, bool]) -> StandIn:
    """What SGLang's router answers on GET /workers: each replica and whether its health checks pass."""

    async def workers(_: web.Request) -> web.Response:
        listed = [{"url": url, "is_healthy": ok} for url, ok in healthy.items()]
        return web.json_response({"workers": listed})

    return StandIn([web.get("/workers", workers)])


@dataclass
class Replicas:
    servers: list[StandIn]
    served: Counter[str]
    healthy: dict[str, bool]
    gateway: AdapterGateway


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[Replicas]:
    served: Counter[str] = Counter()
    servers = [_replica("a", served), _replica("b", served)]
    healthy = {server.url: True for server in servers}
    router = _router(healthy)
    for server in (*servers, router):
        await server.start()
    gateway = AdapterGateway(None, unreachable_wait=5)
    gateway.start()
    gateway.set_served(["agent@1"])
    gateway.set_upstream([server.url for server in servers], health=router.url)
    try:
        yield Replicas(servers, served, healthy, gateway)
    finally:
        gateway.close()
        for server in (*servers, router):
            await server.close()


async def _answered_by(gateway: AdapterGateway, conversations: range) -> list[str]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30, trust_env=False) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    "/v1/chat/completions",
                    json={"model": "agent@1", "messages": [{"role": "user", "content": f"game {n}"}]},
                )
                for n in conversations
            )
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["replica"] for r in responses]


@pytest.mark.asyncio
async def test_requests_spread_over_replicas_and_skip_one_that_refuses(replicas: Replicas) -> None:
    assert sorted(set(await _answered_by(replicas.gateway, range(8)))) == ["a", "b"]
    await replicas.servers[0].stop()  # its port now refuses connections: no request is lost to it
    assert set(await _answered_by(replicas.gateway, range(8, 16))) == {"b"}


@pytest.mark.asyncio
async def test_a_replica_the_router_finds_failing_gets_no_request(replicas: Replicas) -> None:
    replicas.healthy[replicas.servers[1].url] = False
    await asyncio.sleep(3 * HEALTH_POLL_S)
    served = replicas.served["b"]
    assert set(await _answered_by(replicas.gateway, range(8))) == {"a"}
    assert replicas.served["b"] == served
    replicas.healthy[replicas.servers[1].url] = True
    await asyncio.sleep(3 * HEALTH_POLL_S)
    assert sorted(set(await _answered_by(replicas.gateway, range(8, 16)))) == ["a", "b"]


@pytest.mark.asyncio
async def test_with_no_server_routed_a_request_waits_for_one(replicas: Replicas) -> None:
    """One server (not `replicated`) is down only while it restarts: a request waits for it."""
    replicas.gateway.set_upstream([])
    waiting = asyncio.ensure_future(_answered_by(replicas.gateway, range(1)))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    replicas.gateway.set_upstream([replicas.servers[1].url])
    assert await asyncio.wait_for(waiting, 5) == ["b"]


@pytest.mark.asyncio
async def test_replicas_none_of_which_is_routed_are_a_503_at_once() -> None:
    gateway = AdapterGateway(None, unreachable_wait=600, replicated=True)
    gateway.start()
    try:
        gateway.set_served(["agent@1"])
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=5, trust_env=False) as http:
            body = {"model": "agent@1", "messages": [{"role": "user", "content": "hi"}]}
            refused = await http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503, refused.text
        assert "no inference server replica is up" in refused.json()["error"]["message"]
    finally:
        gateway.close()
