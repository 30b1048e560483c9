"""One request or one crash at the adapters' moment, on real SGLang with one GPU (shared mode, the `sleep`
handoff): `n > 1` on an adapter in every spelling is refused by the gateway and the three steps after it
are published; a server killed as a step's adapter loads is waited out and the step served. The CPU twin
is tests/faults/test_adapter_faults.py; what SGLang itself makes of each spelling of `n`,
tests/contract/test_adapter_release.py.

    pytest -m gpu tests/gpu/test_adapter_faults_on_gpu.py    (1 GPU; suite adapter-faults)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import pytest_asyncio
from gpu_helpers import make_groups, record, sglang_test_config

from art_sglang import SGLangBackend, TrainableModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import assert_n_refused, chat, step_with_server_killed_as_it_loads

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

LEARNING_RATE = 0.02
STEP_S = 600.0  # a step, a server restart included, within this


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    backend = SGLangBackend(
        engine="sglang",
        inference_device=0,
        training_devices=[0],
        sglang_config=sglang_test_config(adapters_to_keep=1, unresponsive_timeout=30.0),
        path=str(tmp_path_factory.mktemp("adapter-faults") / ".art"),
    )
    model = TrainableModel(name="agent", project="gpu-adapter-faults", base_model=gpu_model)
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


def _gateway(model: TrainableModel) -> str:
    assert model.inference_base_url is not None
    return model.inference_base_url.removesuffix("/v1")


async def _step(backend: SGLangBackend, model: TrainableModel) -> int:
    groups = await make_groups(model.openai_client(), model.get_inference_name())
    result = await asyncio.wait_for(backend.train(model, groups, learning_rate=LEARNING_RATE), STEP_S)
    assert model.get_inference_name() == f"agent@{result.step}"
    assert (await chat(_gateway(model), model.get_inference_name())).status_code == 200
    return result.step


async def test_n_in_every_spelling_is_refused_on_an_adapter_and_three_steps_are_published(run) -> None:
    backend, model = run
    await assert_n_refused(_gateway(model), model.get_inference_name())
    steps = [await _step(backend, model) for _ in range(3)]
    assert steps == [1, 2, 3]
    record("adapter-faults/n-spellings", steps=steps)


async def test_a_server_killed_during_a_steps_adapter_load_is_waited_out(
    run, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = run
    step = await step_with_server_killed_as_it_loads(
        monkeypatch, backend, model, lambda: _step(backend, model)
    )
    record("adapter-faults/killed-during-load", step=step)
