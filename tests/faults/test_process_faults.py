"""Processes that die or hang at awkward moments, with real processes and real signals on CPU: the server
SIGKILLed while train() runs (rollouts keep going), the trainer dying right after writing a checkpoint it
never reported, a SIGSTOPped server, and a SIGSTOPped trainer. One backend for the module (short timeouts
for hung processes); the tests run in order."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
from backend_helpers import chat, kill_tree, sample_groups, server_models

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig, TrainerConfig, TrainerError
from art_sglang.storage.model_store import ModelStore

pytestmark = pytest.mark.asyncio(loop_scope="module")

TRAIN = {"learning_rate": 1e-3, "allow_training_without_logprobs": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def faulty(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    path = tmp_path_factory.mktemp("faults") / ".art"
    backend = SGLangBackend(
        path=str(path),
        sglang_config=SGLangConfig(unresponsive_timeout=5.0),
        trainer_config=TrainerConfig(step_timeout=20.0),
    )
    model = art.TrainableModel(name="agent", project="faults", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield backend, model, ModelStore(path, "faults", "agent")
    finally:
        await backend.close()


def _gateway(model: art.TrainableModel) -> str:
    assert model.inference_base_url is not None
    return model.inference_base_url.removesuffix("/v1")


async def test_server_killed_during_train_only_fails_requests_in_flight(faulty) -> None:
    backend, model, _ = faulty
    service = backend.inference
    assert service is not None
    gateway = _gateway(model)
    groups = await sample_groups(model, seed=1)
    trainer = backend.trainer(model)
    real_train = trainer.train
    killed: dict[str, Any] = {}

    async def train_while_the_server_dies(*args: Any, **kwargs: Any):
        # The server dies while train() holds the backend; the watchdog must restart it anyway.
        pid = service.process.pid
        assert pid is not None
        killed["at"] = time.monotonic()
        kill_tree(pid)
        while not (service.process.is_alive() and service.process.pid != pid):
            await asyncio.sleep(0.1)
        killed["back"] = time.monotonic()
        return await real_train(*args, **kwargs)

    results: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def rollouts() -> None:
        while not stop.is_set():
            began = time.monotonic()
            try:
                status = (await chat(gateway, model.get_inference_name(), max_tokens=4)).status_code
            except Exception:  # the connection broke mid-response
                status = -1
            results.append((began, status))

    workers = [asyncio.create_task(rollouts()) for _ in range(4)]
    trainer.train = train_while_the_server_dies  # type: ignore[method-assign]
    try:
        result = await backend.train(model, groups, **TRAIN)
    finally:
        del trainer.train
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*workers)
    assert result.step == 1 and "back" in killed
    failed = [began for began, status in results if status != 200]
    # Only requests already sent when the server died may fail; every later one waited and succeeded.
    assert all(began < killed["at"] for began in failed), (len(failed), len(results))
    assert len(failed) <= 4
    assert [s for began, s in results if began > killed["back"]] and all(
        s == 200 for began, s in results if began > killed["at"]
    )
    assert "agent@1" in await server_models(service.process.base_url, service.process.config.api_key)


async def test_a_checkpoint_the_dead_trainer_never_reported_is_served(faulty) -> None:
    backend, model, store = faulty
    step = await model.get_step()
    groups = await sample_groups(model, seed=2)
    # The trainer renamed checkpoint step+1 into place and died before reporting it.
    shutil.copytree(store.checkpoint_dir(step), store.checkpoint_dir(step + 1))
    trainer = backend.trainer(model)
    assert trainer.pid is not None
    os.kill(trainer.pid, signal.SIGKILL)
    while trainer.is_alive():
        await asyncio.sleep(0.05)
    flat = art.TrajectoryGroup([t.model_copy(update={"reward": 0.5}) for t in groups[0].trajectories])
    # The restarted trainer resumes at step+1; a batch without learning signal still advances (as in ART).
    result = await backend.train(model, [flat], **TRAIN)
    assert result.step == step + 2 and model.get_inference_name() == f"agent@{step + 2}"
    assert (await chat(_gateway(model), f"agent@{step + 2}")).status_code == 200
    assert (await chat(_gateway(model), f"agent@{step + 1}")).status_code == 200  # on disk: loaded on request


async def test_a_stopped_server_is_restarted_and_requests_wait(faulty) -> None:
    backend, model, _ = faulty
    service = backend.inference
    assert service is not None
    stopped = service.process.pid
    assert stopped is not None
    kill_tree(stopped, signal.SIGSTOP)
    # Sent to the stopped server: it fails when the hung process is killed, or waits for the new one.
    name = model.get_inference_name()
    reply = await chat(_gateway(model), name)
    if reply.status_code != 200:  # it was in flight when the hung process was killed
        reply = await chat(_gateway(model), name)
    assert reply.status_code == 200
    assert service.process.pid not in (None, stopped) and not psutil.pid_exists(stopped)


async def test_a_stopped_trainer_is_an_error_not_a_hang(faulty) -> None:
    backend, model, _ = faulty
    name = model.get_inference_name()
    groups = await sample_groups(model, seed=3)
    trainer = backend.trainer(model)
    pid = trainer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    with pytest.raises(TrainerError, match="step_timeout"):
        await backend.train(model, groups, **TRAIN)
    assert not trainer.is_alive() and not psutil.pid_exists(pid)
    assert model.get_inference_name() == name
    assert (await chat(_gateway(model), name)).status_code == 200
