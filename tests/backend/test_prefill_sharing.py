"""Prefill sharing in the gateway, in front of a real reference-engine server with a loaded adapter: the
first request of a prompt goes at once, those that follow it wait for one prefill-only request and then go
as they came, finding the prompt cached; a request that shares nothing waits for nothing; held requests
count as in flight (an unload waits for them); a caller that leaves while held; the off switch; and `n > 1`
on an adapter is refused (SGLang 0.5.17 would never release the adapter)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from backend_helpers import server_with_adapter
from openai import AsyncOpenAI

from art_sglang.server.gateway import AdapterGateway
from art_sglang.server.process import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
# Wide enough that concurrent test requests always meet in one window on a busy CI machine.
WINDOW = 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    async with server_with_adapter(tiny_model_path, tmp_path_factory.mktemp("sharing")) as process:
        yield process


@contextlib.contextmanager
def _gateway(server: ServerProcess, window: float) -> Iterator[AdapterGateway]:
    gateway = AdapterGateway(server.base_url, share_window=window)
    gateway.start()
    gateway.set_served(["agent@1"], [server.model_path])
    try:
        yield gateway
    finally:
        gateway.close()


@pytest.fixture
def gateway(server: ServerProcess) -> Iterator[AdapterGateway]:
    with _gateway(server, WINDOW) as gw:
        yield gw


async def _requests_since(server: ServerProcess, mark: int, expected: int) -> list[str]:
    """The server's log lines of inference requests on the adapter written after byte `mark`, once
    `expected` are there (a request's line is written just after its response, so an earlier request's
    line may still come after the mark: the base model's are left out) and no more came in a short while."""

    def lines() -> list[str]:
        text = server.log_path.read_text()[mark:]
        pattern = r"POST /v1/(chat/)?completions \d{3} .*adapter=agent@1 "
        return [line for line in text.splitlines() if re.search(pattern, line)]

    deadline = time.monotonic() + 10
    while len(lines()) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    return lines()


def _mark(server: ServerProcess) -> int:
    return len(server.log_path.read_text())


def _field(line: str, name: str) -> int:
    match = re.search(rf"\b{name}=(\d+)", line)
    assert match, line
    return int(match.group(1))


def _rollout(content: str = "play a move", **extra: object) -> dict:
    return {
        "model": "agent@1",
        "messages": [
            {"role": "system", "content": "You are an agent. " * 8},
            {"role": "user", "content": content},
        ],
        "max_tokens": 6,
        "temperature": 1.0,
        "logprobs": True,
        **extra,
    }


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        return await asyncio.gather(*(http.post(CHAT, json=body) for body in bodies))


async def _first_then(url: str, first: dict, rest: list[dict]) -> list[httpx.Response]:
    """`first` alone, then `rest` together while `first` is still the open batch's first request."""
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        leader = asyncio.create_task(http.post(CHAT, json=first))
        await asyncio.sleep(WINDOW / 5)
        followers = await asyncio.gather(*(http.post(CHAT, json=body) for body in rest))
        return [await leader, *followers]


async def test_rollouts_that_follow_one_find_its_prompt_computed(gateway, server) -> None:
    mark = _mark(server)
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    replies = await asyncio.gather(*(client.chat.completions.create(**_rollout()) for _ in range(6)))
    await client.close()

    lines = await _requests_since(server, mark, 7)
    # The first at once; one prefill-only request (no completion tokens); then the five that followed.
    assert len(lines) == 7, lines
    assert sorted(_field(line, "completion") for line in lines)[0] == 0
    prompt_tokens = {reply.usage.prompt_tokens for reply in replies}
    assert len(prompt_tokens) == 1
    cached = [(getattr(reply.usage.prompt_tokens_details, "cached_tokens", 0) or 0) for reply in replies]
    assert sum(c >= 0.8 * reply.usage.prompt_tokens for c, reply in zip(cached, replies, strict=True)) >= 5
    for reply in replies:  # each answered as it was asked, untouched
        choice = reply.choices[0]
        assert len(reply.choices) == 1 and len(choice.logprobs.content) == len(choice.token_ids)  # type: ignore[attr-defined]
    counters = gateway.prefill_counters()
    assert counters == {
        "requests_held": 5,
        "prefill_requests": 1,
        "prefill_tokens_saved": 4 * prompt_tokens.pop(),
    }


async def test_mixed_requests_on_one_prompt_share_one_prefill(gateway, server) -> None:
    mark = _mark(server)
    rest = [
        _rollout(),
        _rollout(max_tokens=3),
        _rollout(seed=11),
        _rollout(stream=True),
        _rollout("something else entirely"),  # another prompt: first of its own
    ]
    responses = await _first_then(gateway.base_url, _rollout(), rest)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert "data:" in responses[4].text and "[DONE]" in responses[4].text
    assert responses[2].json()["usage"]["completion_tokens"] <= 3
    # The first; one prefill-only request; the four that followed it, each as it came; the other prompt.
    assert len(await _requests_since(server, mark, 7)) == 7
    # The seeded request got what the same request gets alone.
    alone = (await _post_all(gateway.base_url, [_rollout(seed=11)]))[0]
    assert alone.json()["choices"][0]["message"] == responses[3].json()["choices"][0]["message"]
    assert gateway.prefill_counters()["prefill_requests"] == 1


async def test_a_request_that_shares_nothing_is_not_held(server) -> None:
    # A window far longer than any answer here: a request held for company would take at least that.
    with _gateway(server, 60.0) as gateway:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
            started = time.monotonic()
            response = await http.post(CHAT, json={**_rollout("alone"), "max_tokens": 1})
            assert response.status_code == 200 and time.monotonic() - started < 30


async def test_a_caller_that_leaves_while_held_leaves_the_others_unharmed(gateway, server) -> None:
    body = _rollout("patience")
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
        leader = asyncio.create_task(http.post(CHAT, json=body))
        await asyncio.sleep(WINDOW / 5)
        followers = [asyncio.create_task(http.post(CHAT, json=body)) for _ in range(3)]
        await asyncio.sleep(WINDOW / 5)
        followers[0].cancel()
        done = await asyncio.gather(leader, *followers, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in (done[0], *done[2:])), done
    assert gateway.prefill_counters()["requests_held"] == 2


async def test_requests_held_count_as_in_flight(server) -> None:
    with _gateway(server, 3.0) as gateway:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
            assert (await http.post(CHAT, json=_rollout("held"))).status_code == 200
            follower = asyncio.create_task(http.post(CHAT, json=_rollout("held")))
            await asyncio.sleep(0.5)
            # The follower waits in its window; an unload drains the name first and must see it.
            assert not follower.done() and gateway.in_flight("agent@1") == 1
            assert (await follower).status_code == 200
        assert await gateway.wait_idle("agent@1", timeout=5)


async def test_n_on_an_adapter_is_refused_and_the_off_switch_forwards_at_once(gateway, server) -> None:
    refused = (await _post_all(gateway.base_url, [_rollout(n=2)]))[0]
    assert refused.status_code == 400 and "n=2 on a LoRA adapter" in refused.json()["error"]["message"]
    base = (await _post_all(gateway.base_url, [_rollout(n=2, model=server.model_path)]))[0]
    assert base.status_code == 200 and len(base.json()["choices"]) == 2

    gateway.set_prefill_sharing(False)
    mark = _mark(server)
    responses = await _post_all(gateway.base_url, [_rollout("off")] * 3)
    assert all(r.status_code == 200 for r in responses)
    lines = await _requests_since(server, mark, 3)
    assert len(lines) == 3 and all(_field(line, "completion") > 0 for line in lines)
    assert gateway.prefill_counters()["requests_held"] == 0
