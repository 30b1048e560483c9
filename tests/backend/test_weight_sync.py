"""The other weight-sync methods on CPU: "disk" (merge into the base weights, update_weights_from_disk,
`<name>@<step>` routed to the base slot by the gateway) and "restart" (a new server process with the
adapter preloaded)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from backend_helpers import bearer, chat, sample_groups, server_models

import art_sglang as art
from art_sglang import ConfigError, SGLangBackend, SGLangConfig
from art_sglang.storage.model_store import ModelStore


async def _greedy(base_url: str, model: str, key: str | None = None) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=60, trust_env=False, headers=bearer(key)) as http:
        response = await http.post(f"{base_url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


async def test_disk_sync_serves_merged_weights_under_the_step_name(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    path = tmp_path / ".art"
    backend = SGLangBackend(path=str(path), sglang_config=SGLangConfig(weight_sync_method="disk"))
    model = art.TrainableModel(name="merged", project="sync", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        service = backend.inference
        assert service is not None
        gateway = model.inference_base_url.removesuffix("/v1")
        assert (await chat(gateway, "merged@0")).status_code == 200  # step 0 is the base weights
        before = await _greedy(gateway, "merged@0")
        groups = await sample_groups(model, seed=3)
        result = await backend.train(model, groups, learning_rate=5e-2, allow_training_without_logprobs=True)
        assert result.step == 1
        store = ModelStore(path, "sync", "merged")
        merged = store.merged_dir(1)
        assert (merged / "config.json").exists() and any(merged.glob("*.safetensors"))
        key = service.process.config.api_key
        async with httpx.AsyncClient(timeout=30, trust_env=False, headers=bearer(key)) as http:
            info = (await http.get(f"{service.process.base_url}/server_info")).json()
        assert info["internal_states"][0]["weights_path"] == str(merged)
        # No adapter is loaded: the step name is served by the (merged) base slot.
        assert not [
            n
            for n in await server_models(service.process.base_url, service.process.config.api_key)
            if n.startswith("merged@")
        ]
        assert (await chat(gateway, "merged@1")).status_code == 200
        assert (await chat(gateway, "merged@0")).status_code == 404  # the old weights are gone
        assert await _greedy(gateway, "merged@1") == await _greedy(
            service.process.base_url, model.base_model, key
        )
        assert await _greedy(gateway, "merged@1") != before
        # One model per server with merged weights.
        other = art.TrainableModel(name="second", project="sync", base_model=str(tiny_model_path))
        with pytest.raises(ConfigError, match="only one model"):
            await other.register(backend)
    finally:
        await backend.close()


async def test_restart_sync_preloads_the_adapter_in_a_new_server(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    backend = SGLangBackend(
        path=str(tmp_path / ".art"), sglang_config=SGLangConfig(weight_sync_method="restart")
    )
    model = art.TrainableModel(name="fresh", project="sync", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        service = backend.inference
        assert service is not None
        pid = service.process.pid
        result = await backend.train(
            model,
            await sample_groups(model, seed=4),
            learning_rate=1e-3,
            allow_training_without_logprobs=True,
        )
        assert result.step == 1 and service.process.pid != pid
        listed = {
            n
            for n in await server_models(service.process.base_url, service.process.config.api_key)
            if n.startswith("fresh@")
        }
        assert listed == {"fresh@1"}
        assert (await chat(model.inference_base_url.removesuffix("/v1"), "fresh@1")).status_code == 200
    finally:
        await backend.close()
