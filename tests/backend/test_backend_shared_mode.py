"""Shared mode forced on CPU, both strategies: during training the server is released ("sleep", the
reference engine reports it) or down ("restart"), requests sent meanwhile wait in the gateway instead of
failing, and afterwards the new adapter is served (same server process for sleep, a new one for restart).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from backend_helpers import bearer, chat, sample_groups, server_models

import art_sglang as art
from art_sglang import SGLangBackend
from art_sglang.planning.devices import DeviceLayout

pytestmark = pytest.mark.asyncio(loop_scope="module")

CPU_SHARED = DeviceLayout("shared", "reference", (), (), "forced on CPU for tests")


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["sleep/kv_cache", "sleep/all", "restart"]
)
async def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
):
    strategy, _, release = request.param.partition("/")
    path = tmp_path_factory.mktemp(f"shared-{strategy}-{release}") / ".art"
    backend = SGLangBackend(
        path=str(path),
        layout=CPU_SHARED,
        shared_strategy=strategy,
        sglang_config=art.SGLangConfig(sleep_release=release or "auto", enable_metrics=True),
    )
    model = art.TrainableModel(name="agent", project="shared", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


async def _server_state(backend: SGLangBackend) -> dict[str, Any]:
    service = backend.inference
    assert service is not None
    if not service.process.is_alive():
        return {"alive": False}
    headers = bearer(service.process.config.api_key)
    async with httpx.AsyncClient(timeout=10, trust_env=False, headers=headers) as http:
        info = (await http.get(f"{service.process.base_url}/server_info")).json()
        metrics = (await http.get(f"{service.process.base_url}/metrics")).text.splitlines()
    weights = next(line for line in metrics if line.startswith("sglang:weight_memory_usage_gb"))
    return {
        "alive": True,
        "released": info["internal_states"][0]["memory_released"],
        "weights_held": float(weights.rsplit(" ", 1)[1]) > 0,
    }


async def test_training_takes_the_server_away_and_gives_it_back(shared) -> None:
    backend, model = shared
    service = backend.inference
    assert service is not None and backend.layout.mode == "shared"
    strategy = backend.handoff_strategy
    pid_before = service.process.pid
    gateway = model.inference_base_url.removesuffix("/v1")
    groups = await sample_groups(model, seed=1)

    # Observe the server from inside the trainer's turn (the real trainer still does the work).
    trainer = backend.trainer(model)
    real_train = trainer.train
    seen: dict[str, Any] = {}

    async def observed_train(*args: Any, **kwargs: Any):
        seen.update(await _server_state(backend))
        # A rollout sent now waits in the gateway until the server is back, then succeeds.
        seen["waiting"] = asyncio.create_task(chat(gateway, "agent@0"))
        await asyncio.sleep(0.3)
        seen["done_while_training"] = seen["waiting"].done()
        return await real_train(*args, **kwargs)

    trainer.train = observed_train  # type: ignore[method-assign]
    try:
        result = await backend.train(model, groups, learning_rate=1e-3, allow_training_without_logprobs=True)
    finally:
        del trainer.train
    if strategy == "sleep":
        assert seen["alive"] and seen["released"] is True
        # "kv_cache" keeps the base weights on the server; "all" releases them too.
        assert seen["weights_held"] is (backend.sglang_config.sleep_release == "kv_cache")
        assert service.process.pid == pid_before
    else:
        assert seen["alive"] is False
        assert service.process.pid != pid_before
    assert seen["done_while_training"] is False
    assert (await seen["waiting"]).status_code == 200
    assert await _server_state(backend) == {"alive": True, "released": False, "weights_held": True}
    assert result.step == 1 and result.metrics["time/gpu_release_s"] >= 0
    assert result.metrics["time/gpu_resume_s"] >= 0
    assert "agent@1" in await server_models(service.process.base_url, service.process.config.api_key)
    assert (await chat(gateway, "agent@1")).status_code == 200


async def test_bad_input_never_takes_the_server_away(shared) -> None:
    backend, model = shared
    service = backend.inference
    assert service is not None
    pid = service.process.pid
    no_choice = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=r)
            for r in (0.0, 1.0)
        ]
    )
    with pytest.raises(art.TrainingInputError, match="no trajectory of any group has an assistant Choice"):
        await backend.train(model, [no_choice])
    assert service.process.pid == pid
    assert await _server_state(backend) == {"alive": True, "released": False, "weights_held": True}


async def test_a_second_step_and_the_older_adapter_stays_loaded(shared) -> None:
    backend, model = shared
    groups = await sample_groups(model, seed=2)
    result = await backend.train(model, groups, learning_rate=1e-3, allow_training_without_logprobs=True)
    assert result.step == 2
    service = backend.inference
    assert service is not None
    listed = {
        n
        for n in await server_models(service.process.base_url, service.process.config.api_key)
        if n.startswith("agent@")
    }
    # After a restart only the adapters on the wanted list are loaded again: the keep-count still holds.
    assert listed == {"agent@1", "agent@2"}


async def test_pipelined_training_is_refused_with_the_fix(shared) -> None:
    """ART's PipelineTrainer takes an adapter lease per rollout and calls train() while rollouts run; a
    handoff would stop them for every step, so train() refuses before anything changes. (Last in the
    module: the model counts as pipelined from here on.)"""
    backend, model = shared
    service = backend.inference
    assert service is not None
    pid = service.process.pid
    groups = await sample_groups(model, seed=3)
    async with backend.adapter_lease(model, 2):
        assert model.get_inference_name() == "agent@2"
        with pytest.raises(art.ConfigError, match="shared_strategy='co_resident'") as raised:
            await backend.train(model, groups, learning_rate=1e-3)
    assert f"shared_strategy={backend.handoff_strategy!r}" in str(raised.value)
    assert await model.get_step() == 2 and service.process.pid == pid
