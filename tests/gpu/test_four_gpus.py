"""The product description's 4-GPU example on real SGLang: `SGLangBackend(inference_device=0,
training_devices=[1, 2, 3])` — the server on GPU 0, one trainer rank on each of GPUs 1-3 — through a few
steps with rollouts. Each step's adapter is served (and moves away from the one before), and every GPU's
role and memory during the steps are recorded.

    pytest -m gpu tests/gpu/test_four_gpus.py        (4 GPUs; the 1.5B shape, ~4 min)
    ART_SGLANG_GPU_FOUR_MODEL=/root/models/qwen2.5-7b-shape pytest -m gpu tests/gpu/test_four_gpus.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpu_helpers import (
    MemorySampler,
    generate,
    input_logprobs,
    make_groups,
    random_token_ids,
    record,
    sglang_test_config,
    snapshot,
)

from art_sglang import SGLangBackend, TrainableModel

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

STEPS = 3
TRAINING_GPUS = [1, 2, 3]
# Small enough for a random-weight 1.5B/7B model to stay finite; the same adapter served twice gives
# logprobs identical to the last digit on SGLang, so any step that trained shows as a difference above 0.
LEARNING_RATE = 1e-4


@pytest.fixture
def four_gpu_model(gpu_model: str) -> str:
    """The model of the run: ART_SGLANG_GPU_FOUR_MODEL, else the device's 1.5B shape, else the tiny one."""
    return (
        os.environ.get("ART_SGLANG_GPU_FOUR_MODEL") or os.environ.get("ART_SGLANG_GPU_REALISTIC") or gpu_model
    )


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


async def test_the_four_gpu_example_trains_on_three_gpus_and_serves_every_step(
    four_gpu_model: str, gpu_count: int, tmp_path: Path
) -> None:
    if gpu_count < 4:
        pytest.skip(f"the 4-GPU example needs 4 GPUs, {gpu_count} visible")
    backend = SGLangBackend(
        inference_device=0,
        training_devices=TRAINING_GPUS,
        sglang_config=sglang_test_config(),
        path=str(tmp_path / ".art"),
    )
    described = backend.layout.describe()
    assert backend.layout.mode == "split"
    assert "inference on GPU 0" in described and "1 on GPU 2, 2 on GPU 3" in described, described
    model = TrainableModel(name="agent", project="gpu-four", base_model=four_gpu_model)
    vocab = json.loads((Path(four_gpu_model) / "config.json").read_text())["vocab_size"]
    probe = random_token_ids(64, vocab, seed=7)
    steps: list[dict] = []
    try:
        await model.register(backend)
        client = model.openai_client()
        gateway = (model.inference_base_url or "").removesuffix("/v1")
        previous = input_logprobs(await generate(gateway, probe, lora="agent@0"))
        for step in range(1, STEPS + 1):
            groups = await make_groups(client, model.get_inference_name(), groups=4, size=8, max_tokens=64)
            with MemorySampler() as sampler:
                result = await backend.train(model, groups, learning_rate=LEARNING_RATE)
            assert result.step == step and model.get_inference_name() == f"agent@{step}"
            served = input_logprobs(await generate(gateway, probe, lora=f"agent@{step}"))
            moved = _mean_abs(served, previous)
            assert moved > 0.0, f"step {step}'s adapter serves the previous step's logprobs"
            previous = served
            answer = await client.chat.completions.create(
                model=f"agent@{step}", messages=[{"role": "user", "content": "Say something."}], max_tokens=8
            )
            assert answer.choices[0].message.content is not None
            samples = sampler.samples
            trainer_peak = {gpu: max(s.trainer.get(gpu, 0) for s in samples) for gpu in range(4)}
            server_peak = {gpu: max(s.server.get(gpu, 0) for s in samples) for gpu in range(4)}
            # The server only on GPU 0, a trainer rank working on each training GPU, none on GPU 0.
            assert server_peak[0] > 0 and not any(server_peak[g] for g in TRAINING_GPUS), server_peak
            assert all(trainer_peak[g] > 0 for g in TRAINING_GPUS) and trainer_peak[0] == 0, trainer_peak
            steps.append({
                "step": step, "adapter_moved_mean_abs": moved, "server_mib_peak": server_peak,
                "trainer_mib_peak": trainer_peak, "gpu_mib_total_peak": {
                    gpu: max(s.total.get(gpu, 0) for s in samples) for gpu in range(4)},
                "metrics": {k: v for k, v in result.metrics.items() if k.startswith(("time/", "num_", "loss"))},
            })  # fmt: skip
        listed = {m.id for m in (await client.models.list()).data}
        assert {f"agent@{step}" for step in range(STEPS - 1, STEPS + 1)} <= listed, listed
        idle = snapshot()
    finally:
        await backend.close()
    (log,) = tmp_path.rglob("trainer.log")
    assert "torch.distributed.run" in log.read_text()
    record("four-gpu/steps", model=four_gpu_model, layout=described, steps=steps,
           server_mib_idle=idle.server, trainer_mib_idle=idle.trainer)  # fmt: skip
