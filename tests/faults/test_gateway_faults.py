"""Hostile requests to the adapter gateway in front of a real reference-engine server: the server's admin
API is not reachable through it, a disguised path is decided like the plain one (and never redirected to
the server), oversized bodies are 413 and malformed or absurdly nested JSON is 400."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from backend_helpers import StandIn

from art_sglang import SGLangConfig
from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.client import ServerClient
from art_sglang.serving.servers.process import ServerProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMIT = 1024 * 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    log = tmp_path_factory.mktemp("gateway-faults") / "server.log"
    server = ServerProcess(SGLangConfig(), str(tiny_model_path), engine="reference", log_path=log)
    await server.start()
    gw = AdapterGateway(server.base_url, max_body_bytes=LIMIT)
    try:
        gw.start()
        gw.set_served([], [str(tiny_model_path)])
        yield gw, server
    finally:
        gw.close()
        await server.stop()


async def _send(url: str, method: str, path: str, content: bytes = b"") -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        return await http.request(method, path, content=content, headers={"content-type": "application/json"})


async def test_admin_routes_are_404_and_change_nothing(gateway, tiny_model_path: Path) -> None:
    gw, server = gateway
    body = f'{{"lora_name": "sneaky", "lora_path": "{tiny_model_path}"}}'.encode()
    for method, path, content in [
        ("POST", "/load_lora_adapter", body),
        ("POST", "/Load_Lora_Adapter/", body),
        ("POST", "/%6coad_lora_adapter", body),
        ("POST", "/release_memory_occupation", b"{}"),
        ("POST", "/update_weights_from_disk", b'{"model_path": "/nowhere"}'),
        ("GET", "/server_info", b""),
        ("GET", "/get_server_info", b""),
    ]:
        refused = await _send(gw.base_url, method, path, content)
        assert refused.status_code == 404, (path, refused.text)
    async with ServerClient(server.base_url) as client:
        assert [card.id for card in await client.list_models()] == [str(tiny_model_path)]
    info = (await _send(server.base_url, "GET", "/get_server_info", b"")).json()
    assert info["internal_states"][0]["memory_released"] is False


async def test_disguised_paths_are_decided_like_the_plain_one(gateway) -> None:
    gw, server = gateway
    chat = b'{"model": "agent@404", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    for path in (
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/v1/chat/%63ompletions",
        "/v1//chat/completions",
    ):
        refused = await _send(gw.base_url, "POST", path, chat)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", path
    base = chat.replace(b"agent@404", server.model_path.encode())
    answered = await _send(gw.base_url, "POST", "/v1/chat/completions/", base)
    assert answered.status_code == 200 and "location" not in answered.headers


async def test_oversized_bodies_are_413(gateway) -> None:
    gw, _ = gateway
    big = b'{"model": "x", "prompt": "' + b"a" * (2 * LIMIT) + b'"}'
    refused = await _send(gw.base_url, "POST", "/v1/completions", big)
    assert refused.status_code == 413 and "limit" in refused.json()["error"]["message"]


async def test_malformed_and_deep_json_is_400(gateway) -> None:
    gw, _ = gateway
    for body in (b"{not json", b"[" * 100_000 + b"]" * 100_000, b"[1]"):
        refused = await _send(gw.base_url, "POST", "/v1/chat/completions", body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200  # the gateway is still fine


async def test_a_json_schema_nested_too_deeply_is_400_naming_the_field(
    gateway, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gw, server = gateway
    schema = '{"type":"array","items":' * 2000 + '{"type":"string"}' + "}" * 2000
    chat = {"model": str(tiny_model_path), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response_format = '{"type":"json_schema","json_schema":{"name":"x","schema":' + schema + "}}"
    bodies = {
        "json_schema": json.dumps({**chat, "json_schema": schema}).encode(),
        "response_format": json.dumps(chat)[:-1].encode()
        + b', "response_format": '
        + response_format.encode()
        + b"}",
    }
    for field, body in bodies.items():
        refused = await _send(gw.base_url, "POST", "/v1/chat/completions", body)
        assert refused.status_code == 400 and "nested too deeply" in refused.text, refused.text
        # A schema object this deep makes the body itself too deep to read (no field to name then).
        assert refused.json()["error"]["param"] == (field if field == "json_schema" else None)
    # The reference engine reads constraints with the same rules (SGLang itself is not asked here).
    direct = await _send(server.base_url, "POST", "/v1/chat/completions", bodies["json_schema"])
    assert direct.status_code == 400 and "nested too deeply" in direct.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_connection_the_server_drops_before_answering_is_sent_once_more() -> None:
    """A server that dies leaves kept-alive connections that break only when reused; the gateway sends
    such a request once more (it then waits for the restart), but never twice."""
    hangups: list[int] = []  # connections closed without an answer, per upstream behaviour below
    requests = 0

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        await reader.readexactly(length)
        requests += 1
        if hangups and hangups[0] > 0:
            hangups[0] -= 1
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gw = AdapterGateway(f"http://127.0.0.1:{port}", unreachable_wait=30)
    gw.start()
    chat = b'{"model": "agent@1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    try:
        gw.set_served(["agent@1"])
        hangups[:] = [1]
        resent = await _send(gw.base_url, "POST", "/v1/chat/completions", chat)
        assert resent.status_code == 200 and requests == 2
        hangups[:] = [100]
        requests = 0
        dropped = await _send(gw.base_url, "POST", "/v1/chat/completions", chat)
        assert dropped.status_code == 502 and requests == 2, dropped.text
        assert "ServerDisconnectedError" in dropped.json()["error"]["message"]
    finally:
        gw.close()
        server.close()
        await server.wait_closed()


async def test_a_client_that_closes_after_done_leaves_no_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ART's client closes a stream once it read `[DONE]`, while the gateway may still be ending the response
    (a race, lost in ~5 % of rollouts). The race is made certain: the client's side of the connection closes
    just before the gateway ends its response."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    upstream = StandIn([web.post("/{path:.*}", stream)])
    await upstream.start()
    gw = AdapterGateway(upstream.url)
    write_eof = web.StreamResponse.write_eof
    ended = []

    async def client_gone_first(self: web.StreamResponse, data: bytes = b"") -> None:
        request = self._req  # the gateway's response to the client, not the stand-in's to the gateway
        if request is not None and request.url.port == gw.port and request.transport is not None:
            request.transport.close()
            ended.append(request.path)
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", client_gone_first)
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        gw.start()
        gw.set_served([], ["base"])
        with caplog.at_level(logging.WARNING):
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{gw.base_url}/v1/chat/completions", json=body) as reply,
            ):
                assert reply.status == 200
                lines = []
                async for line in reply.content:  # up to [DONE], then the connection is let go, as ART does
                    lines.append(line.strip())
                    if lines[-1] == b"data: [DONE]":
                        break
            await asyncio.sleep(0.5)
        assert lines[-1] == b"data: [DONE]" and set(ended) == {"/v1/chat/completions"}
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        gw.close()
        await upstream.close()
