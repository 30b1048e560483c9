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

from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.process import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
# Long enough that concurrent test requests always find the first still waiting on a busy CI machine.
LEAD = 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    async with server_with_adapter(tiny_model_path, tmp_path_factory.mktemp("sharing")) as process:
        yield process


@contextlib.contextmanager
def _gateway(server: ServerProcess, lead: float) -> Iterator[AdapterGateway]:
    gateway = AdapterGateway(server.base_url, share_lead=lead)
    gateway.start()
    gateway.set_served(["agent@1"], [server.model_path])
    try:
        yield gateway
    finally:
        gateway.close()


@pytest.fixture
def gateway(server: ServerProcess) -> Iterator[AdapterGateway]:
    with _gateway(server, LEAD) as gw:
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
    """`first` alone, then `rest` together while `first` still waits for company."""
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        leader = asyncio.create_task(http.post(CHAT, json=first))
        await asyncio.sleep(LEAD / 5)
        followers = await asyncio.gather(*(http.post(CHAT, json=body) for body in rest))
        return [await leader, *followers]


async def test_rollouts_that_follow_one_find_its_prompt_computed(gateway, server) -> None:
    mark = _mark(server)
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    replies = await asyncio.gather(*(client.chat.completions.create(**_rollout()) for _ in range(6)))
    await client.close()

    lines = await _requests_since(server, mark, 7)
    # One prefill-only request (no completion tokens), then the six as they came.
    assert len(lines) == 7, lines
    assert sum(_field(line, "completion") == 0 for line in lines) == 1
    prompt_tokens = {reply.usage.prompt_tokens for reply in replies}
    assert len(prompt_tokens) == 1
    for reply in replies:  # each answered as it was asked, untouched, the prompt found computed
        details = reply.usage.prompt_tokens_details
        assert (getattr(details, "cached_tokens", 0) or 0) >= 0.8 * reply.usage.prompt_tokens
        choice = reply.choices[0]
        assert len(reply.choices) == 1 and len(choice.logprobs.content) == len(choice.token_ids)  # type: ignore[attr-defined]
    # Those that came after the prefill-only request returned went at once, without waiting.
    counters = gateway.prefill_counters()
    held = counters["requests_held"]
    assert counters["prefill_requests"] == 1 and 2 <= held <= 6
    assert counters["prefill_tokens_saved"] == (held - 1) * prompt_tokens.pop()


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


async def test_a_request_that_shares_nothing_waits_the_lead_at_most(server) -> None:
    body = {**_rollout("alone"), "max_tokens": 1}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        started = time.monotonic()
        assert (
            await http.post(server.base_url + CHAT, json={**body, "lora_path": "agent@1"})
        ).status_code == 200
        direct = time.monotonic() - started
        for lead in (0.0, 1.0):
            with _gateway(server, lead) as gateway:
                started = time.monotonic()
                response = await http.post(gateway.base_url + CHAT, json=body)
                waited = time.monotonic() - started - direct
                assert response.status_code == 200
                # Alone, it waited for company as long as the lead (its own answer is a few ms either way).
                assert waited < lead + 1.0 and (lead == 0 or waited > 0.9 * lead), (lead, waited)


async def test_a_caller_that_leaves_while_held_leaves_the_others_unharmed(server) -> None:
    body = _rollout("patience")
    with _gateway(server, 3.0) as gateway:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
            leader = asyncio.create_task(http.post(CHAT, json=body))
            await asyncio.sleep(0.3)
            leader.cancel()  # it left while waiting for company; the prompt's next request is not stuck
            followers = await asyncio.gather(*(http.post(CHAT, json=body) for _ in range(2)))
        assert all(r.status_code == 200 for r in followers), [r.text for r in followers]
        assert gateway.prefill_counters()["prefill_requests"] == 1
        assert await gateway.wait_idle("agent@1", timeout=5)


async def test_requests_held_count_as_in_flight(server) -> None:
    with _gateway(server, 3.0) as gateway:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
            first = asyncio.create_task(http.post(CHAT, json=_rollout("held")))
            await asyncio.sleep(0.5)
            # The first waits for company; an unload drains the name first and must see it.
            assert not first.done() and gateway.in_flight("agent@1") == 1
            assert (await first).status_code == 200
        assert await gateway.wait_idle("agent@1", timeout=5)


async def test_every_answer_closes_its_connection(gateway, server) -> None:
    # ART's client (httpx) spends CPU on every idle connection it keeps, per request: keep none.
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
        answered = await http.post(CHAT, json=_rollout("close"))
        streamed = await http.post(CHAT, json=_rollout("close", stream=True))
        refused = await http.post(CHAT, json=_rollout(model="nobody@0"))
        listed = await http.get("/v1/models")
    assert [r.status_code for r in (answered, streamed, refused, listed)] == [200, 200, 404, 200]
    assert all(r.headers["connection"] == "close" for r in (answered, streamed, refused, listed))


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
