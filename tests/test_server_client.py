"""ServerClient against the real reference engine: every admin method, and that refusals become the
right exception carrying the server's own message. The server has an API key and a separate admin key,
given as SGLang takes them (`--config` file); which key opens which route is SGLang's rule."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from contract.contract_helpers import make_adapter

from art_sglang.config import SGLangConfig
from art_sglang.errors import (
    AdapterLoadError,
    AdapterNotLoadedError,
    ServerRequestError,
    ServerUnavailableError,
)
from art_sglang.serving.servers.client import ModelCard, ServerClient
from art_sglang.serving.servers.process import ServerProcess

API_KEY = "test-key"
ADMIN_KEY = "admin-test-key"
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("client-adapters")
    model = str(tiny_model_path)
    return {
        "r4": str(make_adapter(model, root / "r4", rank=4, targets=TARGETS, seed=1)),
        "r16": str(make_adapter(model, root / "r16", rank=16, targets=TARGETS, seed=2)),
    }


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = SGLangConfig(max_lora_rank=8, api_key=API_KEY, enable_metrics=True, server_timeout=120)
    log = tmp_path_factory.mktemp("client-server") / "server.log"
    proc = ServerProcess(
        config, str(tiny_model_path), engine="reference", log_path=log, admin_api_key=ADMIN_KEY
    )
    asyncio.run(proc.start())
    try:
        yield proc
    finally:
        asyncio.run(proc.stop())


async def get(server: ServerProcess, path: str) -> httpx.Response:
    """GET `path` with the API key (routes the client has no method for)."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, trust_env=False) as http:
        return await http.get(path, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[ServerClient]:
    async with ServerClient(server.base_url, api_key=API_KEY, admin_api_key=ADMIN_KEY) as c:
        yield c


async def test_health_and_info(client: ServerClient, server: ServerProcess, tiny_model_path: Path) -> None:
    assert await client.health()
    assert (await get(server, "/get_model_info")).json()["model_path"] == str(tiny_model_path)
    assert (await get(server, "/get_server_info")).json()["port"] == server.port
    assert await client.list_models() == [
        ModelCard(id=str(tiny_model_path), root=str(tiny_model_path), parent=None, max_model_len=4096)
    ]


async def test_adapter_load_list_unload(
    client: ServerClient, adapters: dict[str, str], tiny_model_path: Path
):
    assert await client.load_lora_adapter("m@1", adapters["r4"]) == {"m@1": adapters["r4"]}
    try:
        cards = {card.id: card for card in await client.list_models()}
        assert cards["m@1"].parent == str(tiny_model_path)
        assert cards["m@1"].root == adapters["r4"]

        with pytest.raises(AdapterLoadError, match="already loaded") as dup:
            await client.load_lora_adapter("m@1", adapters["r4"])
        assert dup.value.status == 400
        assert dup.value.server_message == "Failed to load LoRA adapter m@1 because it is already loaded"

        with pytest.raises(AdapterLoadError, match="rank 16 is incompatible"):
            await client.load_lora_adapter("m@16", adapters["r16"])
        with pytest.raises(AdapterLoadError) as missing:
            await client.load_lora_adapter("m@9", "/no/such/adapter")
        assert "/no/such/adapter" in (missing.value.server_message or "")
    finally:
        assert await client.unload_lora_adapter("m@1") == {}
    assert [card.id for card in await client.list_models()] == [str(tiny_model_path)]


async def test_unload_unknown_adapter(client: ServerClient) -> None:
    with pytest.raises(AdapterNotLoadedError, match="zzz does not exist") as info:
        await client.unload_lora_adapter("zzz")
    assert isinstance(info.value, ServerRequestError)
    assert info.value.status == 400


async def test_cache_memory_weights_and_metrics(
    client: ServerClient, server: ServerProcess, tiny_model_path: Path
) -> None:
    await client.flush_cache()
    await client.release_memory_occupation()
    await client.resume_memory_occupation()
    await client.update_weights_from_disk(str(tiny_model_path))
    assert (await get(server, "/health_generate")).status_code == 200  # it generates again
    assert "sglang:" in await client.metrics()


async def test_weight_version_pause_and_a_refused_push(client: ServerClient, server: ServerProcess) -> None:
    """The calls a merged-weight push makes (serving/servers/weight_push.py): a payload that is not
    base64 is refused before anything changes, and the version stays."""
    assert await client.weight_version() == "default"
    await client.pause_generation("abort")
    with pytest.raises(ServerRequestError) as info:
        await client.update_weights_from_tensor(
            "not base64!", load_format=None, flush_cache=True, weight_version="m@1"
        )
    assert info.value.status == 400
    await client.continue_generation()
    assert await client.weight_version() == "default"
    assert (await get(server, "/health_generate")).status_code == 200  # generating again


async def test_update_weights_from_bad_path(client: ServerClient) -> None:
    with pytest.raises(ServerRequestError, match="/nothing/here") as info:
        await client.update_weights_from_disk("/nothing/here")
    assert info.value.status == 400
    assert "Failed to get weights iterator" in (info.value.server_message or "")


async def test_wrong_api_key_is_refused(server: ServerProcess) -> None:
    async with ServerClient(server.base_url, api_key="wrong") as client:
        with pytest.raises(ServerRequestError) as info:
            await client.list_models()
    assert info.value.status == 401
    assert info.value.server_message == "Unauthorized"


async def test_unreachable_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    async with ServerClient(f"http://127.0.0.1:{port}", timeout=2.0) as client:
        assert not await client.health()
        with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{port}/v1/models"):
            await client.list_models()


def test_the_keys_are_not_on_the_servers_command_line(server: ServerProcess) -> None:
    assert server.pid is not None
    command = " ".join(psutil.Process(server.pid).cmdline())
    assert f"--config {server.keys_file}" in command
    assert API_KEY not in command and ADMIN_KEY not in command
    assert not server.keys_file.exists()


async def test_each_key_opens_only_its_routes(server: ServerProcess, client: ServerClient) -> None:
    """Ordinary routes take the API key and not the admin key; admin routes take the admin key and not
    the API key; `x-api-key` counts as Bearer does; /health needs no key."""

    def key(value: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {value}"} if value else {}

    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, trust_env=False) as http:
        assert (await http.get("/v1/models", headers=key(API_KEY))).status_code == 200
        assert (await http.get("/v1/models", headers={"x-api-key": API_KEY})).status_code == 200
        assert (await http.post("/flush_cache", headers=key(ADMIN_KEY))).status_code == 200
        assert (await http.post("/flush_cache", headers={"x-api-key": ADMIN_KEY})).status_code == 200
        for path, wrong in [("/v1/models", ADMIN_KEY), ("/flush_cache", API_KEY)]:
            for given in (wrong, "nonsense", None):
                method = http.get if path == "/v1/models" else http.post
                refused = await method(path, headers=key(given))
                assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}, (
                    path,
                    given,
                )
        assert (await http.get("/health")).status_code == 200
    async with ServerClient(server.base_url, api_key=API_KEY) as without_admin_key:
        assert await without_admin_key.list_models()
        with pytest.raises(ServerRequestError) as info:
            await without_admin_key.flush_cache()
    assert info.value.status == 401
    flags = (await get(server, "/get_server_info")).json()
    assert flags["api_key"] == flags["admin_api_key"] == "<set>"
