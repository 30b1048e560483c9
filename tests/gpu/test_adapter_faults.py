"""One request or one crash at the adapters' moment, on real SGLang with one GPU (shared mode, the `sleep`
handoff): `n > 1` on an adapter in every spelling is refused by the gateway and the three steps after it
are published; a server killed as a step's adapter loads is waited out and the step served. The CPU twin
is tests/faults/test_adapter_faults.py; what SGLang itself makes of each spelling of `n`,
tests/contract/test_adapter_release.py.

    pytest -m gpu tests/gpu/test_adapter_faults.py    (1 GPU; suite adapter-faults)
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from gpu_helpers import make_groups, record, sglang_test_config

from art_sglang import SGLangBackend, TrainableModel
from art_sglang.process_tree import collect_tree
from art_sglang.server.client import ServerClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import chat

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

LEARNING_RATE = 0.02
STEP_S = 600.0  # a step, a server restart included, within this
SPELLINGS = [
    ("/v1/chat/completions", {"n": 2}),
    ("/v1/chat/completions", {"n": 2.0}),
    ("/v1/chat/completions", {"n": "2"}),
    ("/v1/completions", {"n": "2", "prompt": "hi"}),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 2}}),
    ("/generate", {"text": "hi", "sampling_params": {"n": "2", "max_new_tokens": 2}}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}),
]


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
    name = model.get_inference_name()
    async with httpx.AsyncClient(base_url=_gateway(model), timeout=120, trust_env=False) as http:
        for path, fields in SPELLINGS:
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
            if path == "/generate":
                body = {"lora_path": name, **fields}
            refused = await http.post(path, json=body)
            assert refused.status_code == 400, (path, fields, refused.text)
            assert refused.json()["error"]["code"] == "n_with_adapter"
    steps = [await _step(backend, model) for _ in range(3)]
    assert steps == [1, 2, 3]
    record("adapter-faults/n-spellings", steps=steps)


async def test_a_server_killed_during_a_steps_adapter_load_is_waited_out(
    run, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = run
    service = backend.inference
    assert service is not None
    next_name = f"agent@{await model.get_step() + 1}"
    load = ServerClient.load_lora_adapter
    killed: list[int] = []

    async def load_as_the_server_dies(client: ServerClient, name: str, path: str) -> Any:
        if name == next_name and not killed:
            pid = service.process.pid
            assert pid is not None
            killed.append(pid)
            request = asyncio.create_task(load(client, name, path))
            await asyncio.sleep(0.002)  # the load is on its way when the server dies
            for proc in collect_tree(pid):
                proc.send_signal(signal.SIGKILL)
            return await request
        return await load(client, name, path)

    monkeypatch.setattr(ServerClient, "load_lora_adapter", load_as_the_server_dies)
    step = await _step(backend, model)
    assert f"agent@{step}" == next_name and killed and service.process.pid != killed[0]
    record("adapter-faults/killed-during-load", step=step)
