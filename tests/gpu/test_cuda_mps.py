"""Co-resident server and trainer on one GPU as clients of the backend's own CUDA MPS daemon
(`cuda_mps="on"`): both run under the daemon's private pipe directory and the MPS server it starts serves
them, a training step trains and its adapter answers, and close() leaves no MPS process and no pipe
directory behind.

    pytest -m gpu tests/gpu/test_cuda_mps.py      (~3 min on an H100)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
from gpu_helpers import make_groups, record, role_of, sglang_test_config

from art_sglang import SGLangBackend, TrainableModel, TrainerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

PIPE = "CUDA_MPS_PIPE_DIRECTORY"


def pipe_of(proc: psutil.Process) -> str | None:
    """The process's MPS pipe directory ("" if it has none), None if its environment cannot be read (it
    exited meanwhile, or is a zombie)."""
    try:
        return proc.environ().get(PIPE, "")
    except psutil.Error:
        return None


def mps_processes(pipe: str) -> list[psutil.Process]:
    """Every process of the machine that belongs to the daemon with this pipe directory (control, server)."""
    return [p for p in psutil.process_iter(["name"]) if "nvidia-cuda-mps" in (p.info["name"] or "")
            and pipe_of(p) == pipe]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    root = tmp_path_factory.mktemp("cuda-mps")
    backend = SGLangBackend(
        engine="sglang", inference_device=0, training_devices=[0], shared_strategy="co_resident",
        cuda_mps="on", sglang_config=sglang_test_config(mem_fraction_static=0.3),
        trainer_config=TrainerConfig(use_unsloth=False), path=str(root / ".art"),
    )  # fmt: skip
    model = TrainableModel(name="agent", project="gpu-mps", base_model=gpu_model)
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


async def test_server_and_trainer_are_clients_of_the_daemon(run) -> None:
    backend, _ = run
    assert backend.uses_cuda_mps
    pipes: dict[str, set[str]] = {"server": set(), "trainer": set()}
    seen: list[tuple[str, int, str, str]] = []  # the message names a process that is not a client
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a process that exits meanwhile is not counted
            role, pipe, command = role_of(proc), proc.environ().get(PIPE, ""), " ".join(proc.cmdline())
            if role in pipes:
                pipes[role].add(pipe)
                seen.append((role, proc.pid, command[:200], pipe))
    assert backend.inference is not None
    pipe = pipe_of(psutil.Process(backend.inference.process.pid))
    assert pipe and pipes == {"server": {pipe}, "trainer": {pipe}}, (pipe, seen)
    found = {p.info["name"] for p in mps_processes(pipe)}
    # The control daemon starts its MPS server when the first client connects.
    assert {"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"} <= found, found
    record("cuda-mps/register", pipe=pipe, processes=sorted(found))


async def test_a_step_trains_and_is_served(run) -> None:
    backend, model = run
    client = model.openai_client()
    groups = await make_groups(client, model.get_inference_name())
    result = await backend.train(model, groups, learning_rate=1e-3)
    assert model.get_inference_name() == "agent@1"
    reply = await client.chat.completions.create(
        model="agent@1", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    record(
        "cuda-mps/step", step_s=result.metrics.get("time/step_s"), train_s=result.metrics.get("time/train_s")
    )


async def test_close_leaves_no_mps_process_or_directory(run) -> None:
    backend, _ = run
    assert backend.inference is not None
    pipe = pipe_of(psutil.Process(backend.inference.process.pid))
    assert pipe
    await backend.close()
    assert not backend.uses_cuda_mps
    assert mps_processes(pipe) == []
    assert not Path(pipe).exists()
