"""A rollout SGLang refuses for its length (a conversation that outgrew the context, or a `max_tokens`
over it) keeps the adapter it named in use for good on SGLang 0.5.17, so unloading that step's adapter
would block every later adapter load: training would stop at the next step. The reference engine keeps
SGLang's books (tests/contract/test_adapter_release.py); the backend leaves such an adapter loaded and
unrouted, and the steps after it train and are served."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from backend_helpers import bearer, chat, sample_groups, server_models

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.planning.devices import DeviceLayout


async def test_a_length_refused_rollout_does_not_stop_the_next_steps(
    tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SGLangBackend(path=str(tmp_path / ".art"), sglang_config=SGLangConfig(adapters_to_keep=1))
    model = art.TrainableModel(name="agent", project="stranded", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        assert model.inference_base_url is not None and backend.inference is not None
        gateway = model.inference_base_url.removesuffix("/v1")
        server = backend.inference.process
        refused = await chat(gateway, "agent@0", max_tokens=10**7)
        assert refused.status_code == 400 and "context length" in refused.text

        with caplog.at_level(logging.WARNING, logger="art_sglang.serving.adapters"):
            for step in (1, 2):
                groups = await sample_groups(model, seed=step)
                result = await asyncio.wait_for(
                    backend.train(model, groups, learning_rate=1e-3, allow_training_without_logprobs=True),
                    timeout=180,
                )
                assert result.step == step
                assert (await chat(gateway, f"agent@{step}")).status_code == 200
        assert any("agent@0 stays loaded" in r.getMessage() for r in caplog.records)
        on_server = await server_models(server.base_url, server.config.api_key)
        # The stranded step stays on the server, unrouted; an ordinary old step is unloaded as before.
        assert {"agent@0", "agent@2"} <= on_server and "agent@1" not in on_server
        assert (await chat(gateway, "agent@1")).status_code == 200  # loaded again from disk on request
        assert (await chat(gateway, "agent@0")).status_code == 200  # routed again where it still is
    finally:
        await asyncio.wait_for(backend.close(), timeout=120)


async def test_a_server_that_must_reload_a_stranded_adapter_is_restarted_instead(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Shared mode releasing the weights reloads every adapter after the step: one SGLang cannot unload
    would hang that, so the server is restarted with the adapters instead."""
    backend = SGLangBackend(
        path=str(tmp_path / ".art"),
        layout=DeviceLayout("shared", "reference", (), (), "forced on CPU for tests"),
        shared_strategy="sleep",
        sglang_config=SGLangConfig(sleep_release="all"),
    )
    model = art.TrainableModel(name="agent", project="stranded", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        assert model.inference_base_url is not None and backend.inference is not None
        gateway = model.inference_base_url.removesuffix("/v1")
        first_pid = backend.inference.process.pid
        assert (await chat(gateway, "agent@0", max_tokens=10**7)).status_code == 400
        groups = await sample_groups(model, seed=1)
        result = await asyncio.wait_for(
            backend.train(model, groups, learning_rate=1e-3, allow_training_without_logprobs=True),
            timeout=180,
        )
        assert result.step == 1
        assert backend.inference.process.pid != first_pid
        assert (await chat(gateway, "agent@1")).status_code == 200
    finally:
        await asyncio.wait_for(backend.close(), timeout=120)


async def test_an_adapter_stranded_behind_the_gateways_back_restarts_the_server_after_a_release(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """A request sent to the server directly (`n=2`, which the gateway refuses) strands an adapter the
    gateway knows nothing of: reloading the adapters after a weights release finds it by an unload that
    does not finish (within unresponsive_timeout), and the server is restarted instead."""
    backend = SGLangBackend(
        path=str(tmp_path / ".art"),
        layout=DeviceLayout("shared", "reference", (), (), "forced on CPU for tests"),
        shared_strategy="sleep",
        sglang_config=SGLangConfig(sleep_release="all", unresponsive_timeout=5.0),
    )
    model = art.TrainableModel(name="agent", project="stranded", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        assert backend.inference is not None
        server = backend.inference.process
        first_pid = server.pid
        body = {"model": "x", "lora_path": "agent@0", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        async with httpx.AsyncClient(
            timeout=60, trust_env=False, headers=bearer(server.config.api_key)
        ) as http:
            assert (await http.post(f"{server.base_url}/v1/chat/completions", json=body)).status_code == 200
        groups = await sample_groups(model, seed=1)
        result = await asyncio.wait_for(
            backend.train(model, groups, learning_rate=1e-3, allow_training_without_logprobs=True),
            timeout=90,
        )
        assert result.step == 1 and server.pid != first_pid
        assert model.inference_base_url is not None
        assert (await chat(model.inference_base_url.removesuffix("/v1"), "agent@1")).status_code == 200
    finally:
        await asyncio.wait_for(backend.close(), timeout=120)
