"""Two SGLang replicas on one GPU (each with about half its memory) behind SGLang's router: every step's
adapter is served by both replicas (asked of each directly) through a few training steps, and a replica
killed mid-run is taken out of routing, restarted with every adapter and its share of the GPU, and put
back while the other serves. Uses only the first visible GPU: the trainer of the tiny model runs on CPU
(where it trains is not what this test is about).

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu tests/gpu/test_replicas.py   (sglang-router in the server venv; ~4 min)
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
from gpu_helpers import compute_apps, make_groups, record, sglang_test_config

from art_sglang import SGLangBackend, SGLangConfig, TrainableModel
from art_sglang.planning.devices import DeviceLayout, detect_gpus
from art_sglang.serving.adapters import InferenceService

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import kill_tree, served_by_each  # what each replica serves, asked of it directly

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]


@dataclass
class Replicated:
    backend: SGLangBackend
    model: TrainableModel

    @property
    def service(self) -> InferenceService:
        assert self.backend.inference is not None
        return self.backend.inference


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicated(tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    root = tmp_path_factory.mktemp("replicas")
    # Both replicas on the first visible GPU, the trainer on CPU (no training GPU: its CUDA_VISIBLE_DEVICES
    # is empty); mem_fraction_static left to the backend (an equal share: 0.42 each).
    gpus = detect_gpus().gpus
    layout = DeviceLayout("split", "sglang", (0,), (), "replicas test: one GPU, trainer on CPU",
                          cuda_ids=tuple(g.cuda_id for g in gpus), replica_gpus=((0,), (0,)))  # fmt: skip
    settings = sglang_test_config().model_dump(exclude={"mem_fraction_static"}, exclude_unset=True)
    backend = SGLangBackend(layout=layout, sglang_config=SGLangConfig(**settings), path=str(root / ".art"))
    model = TrainableModel(name="agent", project="gpu-replicas", base_model=gpu_model)
    began = time.monotonic()
    try:
        await model.register(backend)
        record("replicas/register", seconds=round(time.monotonic() - began, 1))
        yield Replicated(backend, model)
    finally:
        await backend.close()


async def test_two_replicas_share_gpu_0_behind_the_router(replicated: Replicated) -> None:
    service = replicated.service
    layout = replicated.backend.layout
    assert layout.replicas == ((0,), (0,)) and backend_gpu_ids(replicated) == (["0"], [])
    assert replicated.backend.sglang_config.mem_fraction_static == 0.42
    assert service.router is not None
    assert await service.router.workers() == {p.base_url: True for p in service.processes}
    held = [_gpu_memory_of(p.pid) for p in service.processes]
    record("replicas/memory", gpu_mib_per_replica=held)
    # Both on the one GPU, with about the same share of it (the second started with the first running).
    assert len(held[0]) == 1 and held[0].keys() == held[1].keys(), held
    first, second = (sum(mib.values()) for mib in held)
    assert 0.75 < first / second < 1.33, held
    assert await served_by_each(service, "agent@0") == ["yes", "yes"]


def backend_gpu_ids(replicated: Replicated) -> tuple[list[str], list[str]]:
    """The CUDA_VISIBLE_DEVICES entries the first replica was given, as this process numbers them (0 = the
    first GPU it sees), and the trainer's GPUs."""
    visible = {g.cuda_id: str(g.index) for g in detect_gpus().gpus}
    first = replicated.service.processes[0].gpu_ids or []
    return [visible[str(i)] for i in first], [str(g) for g in replicated.backend.layout.training_gpus]


def _gpu_memory_of(pid: int | None) -> dict[int, int]:
    """Physical GPU index -> MiB held by a server's process tree (SGLang's scheduler is a child process);
    only this test's own processes are looked at."""
    assert pid is not None
    tree = {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    held: dict[int, int] = {}
    for app, gpu, mib in compute_apps():
        if app in tree:
            held[gpu] = held.get(gpu, 0) + mib
    return held


async def test_every_step_on_both_replicas_with_one_killed_and_recovered(replicated: Replicated) -> None:
    service, model, backend = replicated.service, replicated.model, replicated.backend
    assert service.router is not None
    client = model.openai_client()
    steps = []

    async def train_step(step: int) -> None:
        groups = await make_groups(client, model.get_inference_name())
        result = await backend.train(model, groups, learning_rate=1e-4)
        assert result.step == step
        steps.append(result.metrics.get("time/step_s"))

    await train_step(1)
    assert await served_by_each(service, "agent@1") == ["yes", "yes"]
    victim = service.processes[1]
    killed = kill_tree(victim.pid)
    killed_at = time.monotonic()
    # While it is down (an SGLang start takes a minute or more), rollouts go through the other replica and
    # the next step trains and is served there.
    await train_step(2)
    assert await served_by_each(service, "agent@2", service.processes[:1]) == ["yes"]
    deadline = time.monotonic() + 300
    while not (victim.is_alive() and victim.pid != killed and len(await service.router.workers()) == 2):
        assert time.monotonic() < deadline, "the replica did not come back into the router"
        await asyncio.sleep(0.5)
    back_after = round(time.monotonic() - killed_at, 1)
    # Back in the router with the step trained while it was down.
    assert await served_by_each(service, "agent@2") == ["yes", "yes"]
    await train_step(3)
    assert await served_by_each(service, "agent@3") == ["yes", "yes"]
    # Restarted next to the running one, it took the same share of the GPU again.
    held = [_gpu_memory_of(p.pid) for p in service.processes]
    record("replicas/steps", step_s=steps, replica_back_after_s=back_after,
           gpu_mib_per_replica_after_restart=held)  # fmt: skip
    first, second = (sum(mib.values()) for mib in held)
    assert 0.75 < first / second < 1.33, held
