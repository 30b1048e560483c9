"""What one request or one crash at the adapters' moment can do to a run, on real reference-engine servers
(which keep SGLang 0.5.17's adapter books, tests/contract/test_adapter_release.py): `n > 1` in every
spelling is refused on an adapter, an adapter the gateway could not guard (a request sent to the server
directly) makes its unload time out without stopping later steps, a server killed during a step's
adapter load is waited out, and a step that cannot be served at all says it was saved and what the next
train() does. One backend for the module; the tests run in order."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from backend_helpers import (
    assert_n_refused,
    bearer,
    chat,
    sample_groups,
    server_models,
    step_with_server_killed_as_it_loads,
)

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.errors import ServerUnavailableError
from art_sglang.serving.servers.client import ServerClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

TRAIN = {"learning_rate": 1e-3, "allow_training_without_logprobs": True}
# Each step has this long: an adapter operation that hangs is bounded by unresponsive_timeout (5 s here).
STEP_S = 90.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    backend = SGLangBackend(
        path=str(tmp_path_factory.mktemp("adapter-faults") / ".art"),
        sglang_config=SGLangConfig(adapters_to_keep=1, unresponsive_timeout=5.0),
    )
    model = art.TrainableModel(name="agent", project="adapter-faults", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await asyncio.wait_for(backend.close(), timeout=120)


async def _step(backend: SGLangBackend, model: art.TrainableModel) -> int:
    groups = await sample_groups(model, seed=await model.get_step() + 1)
    result = await asyncio.wait_for(backend.train(model, groups, **TRAIN), timeout=STEP_S)
    assert model.get_inference_name() == f"agent@{result.step}"
    assert (await chat(_gateway(model), model.get_inference_name())).status_code == 200
    return result.step


def _gateway(model: art.TrainableModel) -> str:
    assert model.inference_base_url is not None
    return model.inference_base_url.removesuffix("/v1")


async def test_n_over_one_is_refused_on_an_adapter_in_every_spelling_and_every_step_is_published(run) -> None:
    backend, model = run
    await assert_n_refused(_gateway(model), model.get_inference_name())
    for expected in (1, 2, 3):
        assert await _step(backend, model) == expected


async def test_an_adapter_the_server_cannot_unload_does_not_stop_the_next_steps(
    run, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence in depth: a request the gateway never saw (sent to the server with its own key) keeps the
    current step's adapter in use for good; its unload times out, the adapter stays loaded and unrouted,
    the server stuck in that unload is restarted, and the steps after it are published."""
    backend, model = run
    service = backend.inference
    assert service is not None
    server = service.process
    first_pid = server.pid
    stuck = model.get_inference_name()
    async with httpx.AsyncClient(timeout=60, trust_env=False, headers=bearer(server.config.api_key)) as http:
        body = {"model": "x", "lora_path": stuck, "messages": [{"role": "user", "content": "hi"}], "n": 2}
        assert (await http.post(f"{server.base_url}/v1/chat/completions", json=body)).status_code == 200
    with caplog.at_level(logging.WARNING, logger="art_sglang"):
        step = await _step(backend, model)  # unloads `stuck`: times out after 5 s
        assert any(f"{stuck} stays loaded" in r.getMessage() for r in caplog.records)
        assert await _step(backend, model) == step + 1  # the next load meets no wedged lock
    assert any("stuck in an adapter operation" in r.getMessage() for r in caplog.records)
    assert server.pid != first_pid  # restarted with the published steps
    assert model.get_inference_name() in await server_models(server.base_url, server.config.api_key)


async def test_a_server_killed_during_a_steps_adapter_load_is_waited_out(
    run, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = run
    await step_with_server_killed_as_it_loads(monkeypatch, backend, model, lambda: _step(backend, model))


async def test_a_step_that_cannot_be_served_names_its_saved_step_and_the_next_one_is_published(
    run, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = run
    served = await model.get_step()
    saved = served + 1

    async def unreachable(client: ServerClient, name: str, path: str) -> Any:
        raise ServerUnavailableError(f"POST {client.base_url}/load_lora_adapter failed: ConnectError")

    with monkeypatch.context() as patch:
        patch.setattr(ServerClient, "load_lora_adapter", unreachable)
        groups = await sample_groups(model, seed=saved)
        with pytest.raises(
            ServerUnavailableError, match=rf"Step {saved} of agent was trained and saved"
        ) as told:
            await asyncio.wait_for(backend.train(model, groups, **TRAIN), timeout=STEP_S)
    assert f"publishes step {saved + 1}; step {served} stays served" in str(told.value)
    assert model.get_inference_name() == f"agent@{served}"
    assert await _step(backend, model) == saved + 1
