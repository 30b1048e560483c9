"""AdapterGateway in front of a real reference-engine server with a loaded adapter: a bare adapter name is
routed to the adapter (the server alone answers it with the base model), other names are refused, the
alias rewrite used by disk sync, holding requests, an API key, and a server that is down."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import httpx
import pytest
import pytest_asyncio
from backend_helpers import server_with_adapter
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from art_sglang.serving.gateway.app import ANY, AdapterGateway
from art_sglang.serving.servers.process import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    async with server_with_adapter(tiny_model_path, tmp_path_factory.mktemp("gateway")) as process:
        yield process


@pytest.fixture
def gateway(server: ServerProcess):
    gw = AdapterGateway(server.base_url)
    gw.start()
    gw.set_served(["agent@1"], [server.model_path])
    yield gw
    gw.close()


async def _post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        if isinstance(body, bytes):
            return await http.post(path, content=body, headers=headers)
        return await http.post(path, json=body, headers=headers)


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def test_a_bare_adapter_name_is_routed_to_the_adapter(gateway, server) -> None:
    greedy = {**_chat("agent@1"), "max_tokens": 8, "temperature": 0}
    base = _text(await _post(server.base_url, "/v1/chat/completions", {**greedy, "model": server.model_path}))
    # The trap: the server alone answers the bare adapter name with the base model, echoing the name.
    trap = await _post(server.base_url, "/v1/chat/completions", greedy)
    assert _text(trap) == base and trap.json()["model"] == "agent@1"
    adapter = _text(await _post(server.base_url, "/v1/chat/completions", {**greedy, "lora_path": "agent@1"}))
    assert adapter != base
    routed = await _post(gateway.base_url, "/v1/chat/completions", greedy)
    assert _text(routed) == adapter and routed.json()["model"] == "agent@1"
    prefixed = {**greedy, "model": f"{server.model_path}:agent@1"}
    assert _text(await _post(gateway.base_url, "/v1/chat/completions", prefixed)) == adapter


async def test_rollouts_on_an_adapter_carry_the_sampled_token_ids(gateway, server) -> None:
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    reply = await client.chat.completions.create(
        model="agent@1", messages=messages, max_tokens=5, logprobs=True, temperature=0
    )
    choice = reply.choices[0]
    ids = getattr(choice, "token_ids", None)
    assert choice.model_extra is not None and "prompt_token_ids" in choice.model_extra
    assert isinstance(ids, list) and ids and len(choice.logprobs.content) == len(ids)
    # The ids are what the adapter sampled: they decode to the same text.
    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    # The client's own choice is kept, and the base model and streams are left as they are.
    declined = await client.chat.completions.create(
        model="agent@1", messages=messages, max_tokens=2, extra_body={"return_token_ids": False}
    )
    base = await client.chat.completions.create(model=server.model_path, messages=messages, max_tokens=2)
    assert getattr(declined.choices[0], "token_ids", None) is None
    assert getattr(base.choices[0], "token_ids", None) is None
    text = await client.completions.create(model="agent@1", prompt="hi", max_tokens=2)
    assert text.choices[0].text is not None
    await client.close()


async def test_names_not_loaded_are_refused_on_every_routed_path(gateway, server) -> None:
    url = gateway.base_url
    for body, path in [
        (_chat("agent@0"), "/v1/chat/completions"),
        (_chat("other:agent@1"), "/v1/chat/completions"),
        ({"model": "agent@0", "prompt": "hi", "max_tokens": 2}, "/v1/completions"),
        ({"text": ["a", "b"], "lora_path": ["agent@1", "agent@9"]}, "/generate"),
        ({**_chat(server.model_path), "lora_path": "agent@9"}, "/v1/chat/completions"),
    ]:
        refused = await _post(url, path, body)
        assert refused.status_code == 404, (path, body, refused.text)
        error = refused.json()["error"]
        assert error["code"] == "model_not_found" and "Loaded adapters: agent@1" in error["message"]
    plain = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert (await _post(url, "/generate", plain)).status_code == 200  # no adapter named: base model
    assert await gateway.wait_idle(ANY, timeout=5) and gateway.in_flight(ANY) == 0


async def test_other_paths_and_bodies_pass_through_unchanged(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).json()["data"]
    malformed = await _post(
        gateway.base_url, "/v1/chat/completions", b"{not json", {"content-type": "application/json"}
    )
    assert malformed.status_code == 400  # the server's own answer


async def test_aliases_are_rewritten_to_the_base_model(gateway, server) -> None:
    gateway.set_served([], aliases={"merged@3": server.model_path})
    reply = await _post(gateway.base_url, "/v1/chat/completions", _chat("merged@3"))
    assert reply.status_code == 200 and reply.json()["model"] == server.model_path
    assert (await _post(gateway.base_url, "/v1/chat/completions", _chat("agent@1"))).status_code == 404


async def test_held_requests_wait_and_time_out_with_503(server) -> None:
    gw = AdapterGateway(server.base_url, hold_timeout=0.5)
    gw.start()
    try:
        gw.set_served(["agent@1"], [server.model_path])
        await gw.hold()
        waiting = asyncio.create_task(_post(gw.base_url, "/v1/chat/completions", _chat("agent@1")))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await gw.unhold()
        assert (await waiting).status_code == 200
        await gw.hold()
        late = await _post(gw.base_url, "/v1/chat/completions", _chat("agent@1"))
        assert late.status_code == 503 and "did not come back" in late.json()["error"]["message"]
    finally:
        gw.close()


async def test_api_key_is_checked_before_names_are_listed(server) -> None:
    gw = AdapterGateway(server.base_url, api_key="secret")
    gw.start()
    try:
        gw.set_served(["agent@1"], [server.model_path])
        anonymous = await _post(gw.base_url, "/v1/chat/completions", _chat("agent@0"))
        assert anonymous.status_code == 401 and "agent@1" not in anonymous.text
        keyed = await _post(
            gw.base_url, "/v1/chat/completions", _chat("agent@0"), {"Authorization": "Bearer secret"}
        )
        assert keyed.status_code == 404 and "agent@1" in keyed.text
    finally:
        gw.close()


async def test_a_server_that_is_down_is_a_502(tmp_path: Path) -> None:
    gw = AdapterGateway("http://127.0.0.1:9")  # discard port: nothing listens
    gw.start()
    try:
        gw.set_served(["agent@1"])
        down = await _post(gw.base_url, "/v1/chat/completions", _chat("agent@1"))
        assert down.status_code == 502 and "not reachable" in down.json()["error"]["message"]
    finally:
        gw.close()


async def test_the_log_says_where_the_gateway_forwards_once_it_knows(caplog) -> None:
    gw = AdapterGateway(None)
    with caplog.at_level(logging.INFO, logger="art_sglang.serving.gateway.app"):
        gw.start()
        try:
            gw.set_upstream(["http://127.0.0.1:9"])
            gw.set_upstream(["http://127.0.0.1:9"])  # unchanged: no second line
            gw.set_upstream([])
        finally:
            gw.close()
    assert [record.getMessage() for record in caplog.records] == [
        f"adapter gateway on {gw.base_url} -> http://127.0.0.1:9",
        f"adapter gateway on {gw.base_url} -> no server (requests wait for one)",
    ]


async def test_without_the_gateway_names_use_sglangs_own_adapter_form(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    import art_sglang as art
    from art_sglang import SGLangBackend

    model = art.TrainableModel(name="plain", project="gw-off", base_model=str(tiny_model_path))
    async with SGLangBackend(path=str(tmp_path / ".art"), gateway=False) as backend:
        await model.register(backend)
        service = backend.inference
        assert service is not None and service.gateway is None
        assert model.inference_base_url == f"{service.process.base_url}/v1"
        assert model.get_inference_name() == f"{tiny_model_path}:plain@0"
        async with model.openai_client() as client:  # closed here, not by the GC once the loop is gone
            reply = await client.chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert reply.choices[0].message.content is not None


async def test_a_stream_the_client_leaves_stops_on_the_server(gateway, server) -> None:
    body = {**_chat("agent@1"), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    # aiohttp reads the first chunk without async generators: httpx's, left mid-stream, are finalized whenever
    # the GC gets to them, maybe after this test's event loop closed, where httpcore's cleanup raises inside
    # anyio (an unraisable-exception warning in whichever test runs then).
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gateway.base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        assert await response.content.readany()  # the first chunk; leaving closes the connection
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30, trust_env=False) as http:
        for _ in range(20):  # 3000 tokens would take far longer than these 2 s
            running = (await http.get("/server_info")).json()["internal_states"][0]["running_requests"]
            if running == 0:
                break
            await asyncio.sleep(0.1)
    assert running == 0
    assert await gateway.wait_idle(ANY, timeout=5)
