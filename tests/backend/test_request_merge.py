"""Request merging in the gateway, in front of a real reference-engine server with a loaded adapter: the
first of k identical rollouts goes at once and the other k-1 reach the server as one request with n=k-1,
each caller getting its own choice and usage; mixed traffic on one prompt shares a prefill-only request;
errors and cancellations inside a merged group; the off switch; and requests held in the merge window
count as in flight (an unload waits for them)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from art_sglang import SGLangConfig
from art_sglang.server.client import ServerClient
from art_sglang.server.gateway import AdapterGateway
from art_sglang.server.process import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
# Wide enough that concurrent test requests always meet in one window on a busy CI machine.
WINDOW = 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    log = tmp_path_factory.mktemp("merge") / "server.log"
    adapter = _random_adapter(tiny_model_path, log.parent / "adapter")
    process = ServerProcess(SGLangConfig(), str(tiny_model_path), engine="reference", log_path=log)
    await process.start()
    try:
        async with ServerClient(process.base_url) as client:
            await client.load_lora_adapter("agent@1", str(adapter))
        yield process
    finally:
        await process.stop()


def _random_adapter(base: Path, out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture
def gateway(server: ServerProcess):
    gw = AdapterGateway(server.base_url, merge_window=WINDOW)
    gw.start()
    gw.set_served(["agent@1"], [server.model_path])
    yield gw
    gw.close()


async def _requests_since(server: ServerProcess, mark: int, expected: int) -> list[str]:
    """The server's log lines of inference requests written after byte `mark`, once `expected` are there
    (a request's line is written just after its response) and no more came in a short while."""

    def lines() -> list[str]:
        text = server.log_path.read_text()[mark:]
        return [line for line in text.splitlines() if re.search(r"POST /v1/(chat/)?completions \d{3}", line)]

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


async def test_identical_rollouts_reach_the_server_as_two_requests(gateway, server) -> None:
    mark = _mark(server)
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    replies = await asyncio.gather(*(client.chat.completions.create(**_rollout()) for _ in range(6)))
    await client.close()

    lines = await _requests_since(server, mark, 2)
    # The first went on its own at once; the five that followed within the window went as one.
    assert sorted(_field(line, "n") for line in lines) == [1, 5], lines
    prompt_tokens = {reply.usage.prompt_tokens for reply in replies}
    assert len(prompt_tokens) == 1
    samples = []
    for reply in replies:
        assert len(reply.choices) == 1
        choice = reply.choices[0]
        ids = choice.token_ids  # type: ignore[attr-defined]
        assert choice.index == 0 and ids and len(choice.logprobs.content) == len(ids)
        assert reply.usage.completion_tokens == len(ids)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + len(ids)
        samples.append(tuple(ids))
    assert len({reply.id for reply in replies}) == 6
    # Each caller got its own sample, and together they are what the server sampled.
    assert len(set(samples)) > 1
    served = sum(_field(line, "completion") for line in lines)
    assert sum(reply.usage.completion_tokens for reply in replies) == served
    counters = gateway.merge_counters()
    assert counters["requests_merged"] == 5 and counters["upstream_requests_saved"] == 4
    assert counters["prefill_tokens_saved"] == 4 * prompt_tokens.pop()


async def _first_then(url: str, first: dict, rest: list[dict]) -> list[httpx.Response]:
    """`first` alone, then `rest` together while it is still the open batch's first request."""
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        leader = asyncio.create_task(http.post(CHAT, json=first))
        await asyncio.sleep(WINDOW / 5)
        followers = await asyncio.gather(*(http.post(CHAT, json=body) for body in rest))
        return [await leader, *followers]


async def test_mixed_requests_on_one_prompt_share_one_prefill(gateway, server) -> None:
    mark = _mark(server)
    rest = [
        _rollout(),
        _rollout(),
        _rollout(max_tokens=3),  # another length: its own request
        _rollout(seed=11),  # seeded: its own request, so it samples what it samples alone
        _rollout(stream=True),
        _rollout("something else entirely"),  # another prompt: its own batch
    ]
    responses = await _first_then(gateway.base_url, _rollout(), rest)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    for response in responses[:5]:
        assert len(response.json()["choices"]) == 1
    assert "data:" in responses[5].text and "[DONE]" in responses[5].text
    assert responses[3].json()["usage"]["completion_tokens"] <= 3

    lines = await _requests_since(server, mark, 7)
    # The first request; then one prefill-only request (no completion tokens), the two identical
    # followers as one n=2, and each of the other three alone; the other prompt on its own.
    assert len(lines) == 7, lines
    assert len([line for line in lines if re.search(r"\bn=2\b", line)]) == 1
    assert min(_field(line, "completion") for line in lines if "stream" not in line) == 0
    # The seeded request got what the same request gets alone.
    alone = (await _post_all(gateway.base_url, [_rollout("other words", seed=11)]))[0]
    again = (await _post_all(gateway.base_url, [_rollout("other words", seed=11)]))[0]
    assert alone.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]
    assert gateway.merge_counters()["prefill_requests"] == 1


async def test_a_refused_merged_request_answers_every_caller(gateway, server) -> None:
    mark = _mark(server)
    too_long = _rollout(max_tokens=10**7)
    responses = await _first_then(gateway.base_url, too_long, [too_long] * 3)
    assert [r.status_code for r in responses] == [400] * 4
    assert len({r.text for r in responses}) == 1 and "context length" in responses[0].text
    # The first request alone, and the three that followed it as one.
    assert len(await _requests_since(server, mark, 2)) == 2


async def test_a_caller_that_leaves_does_not_cancel_its_siblings(gateway, server) -> None:
    # Long enough that the merged request is still running when one of its callers leaves.
    long = _rollout("a long answer", max_tokens=300, ignore_eos=True)
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
        leader = asyncio.create_task(http.post(CHAT, json=long))
        await asyncio.sleep(WINDOW / 5)
        followers = [asyncio.create_task(http.post(CHAT, json=long)) for _ in range(3)]
        await asyncio.sleep(WINDOW + 0.4)  # the window closed: the followers' merged request is running
        assert not any(follower.done() for follower in followers)
        followers[0].cancel()
        done = await asyncio.gather(leader, *followers, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    for response in (done[0], *done[2:]):
        assert isinstance(response, httpx.Response) and response.status_code == 200, response
        assert response.json()["usage"]["completion_tokens"] == 300
    assert gateway.merge_counters()["requests_merged"] == 3


async def test_requests_in_their_window_count_as_in_flight(server) -> None:
    gateway = AdapterGateway(server.base_url, merge_window=3.0)
    gateway.start()
    gateway.set_served(["agent@1"], [server.model_path])
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120, trust_env=False) as http:
            assert (await http.post(CHAT, json=_rollout("held"))).status_code == 200
            follower = asyncio.create_task(http.post(CHAT, json=_rollout("held")))
            await asyncio.sleep(0.5)
            # The follower waits in its window; an unload drains the name first and must see it.
            assert not follower.done() and gateway.in_flight("agent@1") == 1
            assert (await follower).status_code == 200
        assert await gateway.wait_idle("agent@1", timeout=5)
    finally:
        gateway.close()


async def test_the_off_switch_forwards_each_request(gateway, server) -> None:
    gateway.set_merging(False)
    mark = _mark(server)
    responses = await _post_all(gateway.base_url, [_rollout("off")] * 3)
    assert all(r.status_code == 200 for r in responses)
    lines = await _requests_since(server, mark, 3)
    assert len(lines) == 3 and all(_field(line, "n") == 1 for line in lines)
    assert gateway.merge_counters()["requests_merged"] == 0
