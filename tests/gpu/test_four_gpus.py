"""The product description's 4-GPU example on real SGLang: `SGLangBackend(inference_device=0,
training_devices=[1, 2, 3])` — the server on GPU 0, one trainer rank on each of GPUs 1-3 — through RL steps
with rollouts, first synchronous (gather, then train), then pipelined (the next step's rollouts gathered on
the current adapter while `train()` runs, one step off policy, as ART's PipelineTrainer does). Each step's
adapter is served (and moves away from the one before), every GPU's role and memory during each step is
sampled with nvidia-smi, and after `close()` no process of the backend is left, on the GPUs or anywhere.

    pytest -m gpu tests/gpu/test_four_gpus.py        (4 GPUs; the 1.5B shape, ~4.5 min)
    ART_SGLANG_GPU_FOUR_MODEL=/root/models/qwen2.5-7b-shape pytest -m gpu tests/gpu/test_four_gpus.py
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpu_helpers import (
    MemorySampler,
    compute_apps,
    generate,
    gpu_used_mib,
    input_logprobs,
    make_groups,
    random_token_ids,
    record,
)

from art_sglang import SGLangBackend, SGLangConfig, TrainableModel

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

SYNCHRONOUS_STEPS = 3
PIPELINED_STEPS = 2
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


class _Run:
    """The steps of one backend and model, each checked and recorded the same way."""

    def __init__(self, backend: SGLangBackend, model: TrainableModel, probe: list[int]) -> None:
        self.backend, self.model, self.probe = backend, model, probe
        self.client = model.openai_client()
        self.gateway = (model.inference_base_url or "").removesuffix("/v1")
        self.previous: list[float] = []
        self.steps: list[dict[str, Any]] = []

    async def rollouts(self, name: str) -> list[Any]:
        return await make_groups(self.client, name, groups=4, size=8, max_tokens=64)

    async def step(self, groups: list[Any], loop: str, next_name: str | None = None) -> list[Any] | None:
        """Train on `groups` with nvidia-smi sampling; with `next_name`, gather the next step's groups on
        that (the current) adapter meanwhile and return them."""
        expected = await self.model.get_step() + 1
        gathering = asyncio.create_task(self.rollouts(next_name)) if next_name else None
        started = time.monotonic()
        with MemorySampler() as sampler:
            result = await self.backend.train(self.model, groups, learning_rate=LEARNING_RATE)
        trained_s = time.monotonic() - started
        assert result.step == expected and self.model.get_inference_name() == f"agent@{expected}"
        served = input_logprobs(await generate(self.gateway, self.probe, lora=f"agent@{expected}"))
        moved = _mean_abs(served, self.previous)
        assert moved > 0.0, f"step {expected}'s adapter serves the previous step's logprobs"
        self.previous = served
        answer = await self.client.chat.completions.create(
            model=f"agent@{expected}", messages=[{"role": "user", "content": "Say something."}], max_tokens=8
        )
        assert answer.choices[0].message.content is not None
        samples = sampler.samples
        trainer_peak = {gpu: max(s.trainer.get(gpu, 0) for s in samples) for gpu in range(4)}
        server_peak = {gpu: max(s.server.get(gpu, 0) for s in samples) for gpu in range(4)}
        # The server only on GPU 0, a trainer rank working on each training GPU, none on GPU 0.
        assert server_peak[0] > 0 and not any(server_peak[g] for g in TRAINING_GPUS), server_peak
        assert all(trainer_peak[g] > 0 for g in TRAINING_GPUS) and trainer_peak[0] == 0, trainer_peak
        gathered = await gathering if gathering is not None else None
        self.steps.append({
            "step": expected, "loop": loop, "train_s": trained_s, "adapter_moved_mean_abs": moved,
            "server_mib_peak": server_peak, "trainer_mib_peak": trainer_peak, "gpu_mib_total_peak": {
                gpu: max(s.total.get(gpu, 0) for s in samples) for gpu in range(4)},
            "rollouts_gathered_meanwhile": sum(len(g.trajectories) for g in gathered or []),
            "metrics": {k: v for k, v in result.metrics.items() if k.startswith(("time/", "num_", "loss"))},
        })  # fmt: skip
        return gathered


async def test_the_four_gpu_example_trains_on_three_gpus_and_serves_every_step(
    four_gpu_model: str, gpu_count: int, tmp_path: Path
) -> None:
    if gpu_count < 4:
        pytest.skip(f"the 4-GPU example needs 4 GPUs, {gpu_count} visible")
    before = gpu_used_mib()
    already = {p.pid for p in psutil.Process().children(recursive=True)}
    backend = SGLangBackend(
        inference_device=0,
        training_devices=TRAINING_GPUS,
        # As a user writes it, but for what this machine needs: no CUDA compiler for FlashInfer's sampling
        # kernels, and the shorter start without CUDA graphs (minutes of device time).
        sglang_config=SGLangConfig(sampling_backend="pytorch", disable_cuda_graph=True),
        path=str(tmp_path / ".art"),
    )
    described = backend.layout.describe()
    assert backend.layout.mode == "split"
    assert "inference on GPU 0" in described and "1 on GPU 2, 2 on GPU 3" in described, described
    model = TrainableModel(name="agent", project="gpu-four", base_model=four_gpu_model)
    vocab = json.loads((Path(four_gpu_model) / "config.json").read_text())["vocab_size"]
    try:
        await model.register(backend)
        run = _Run(backend, model, random_token_ids(64, vocab, seed=7))
        run.previous = input_logprobs(await generate(run.gateway, run.probe, lora="agent@0"))
        for _ in range(SYNCHRONOUS_STEPS):
            await run.step(await run.rollouts(model.get_inference_name()), "synchronous")
        groups = await run.rollouts(model.get_inference_name())
        for _ in range(PIPELINED_STEPS):
            groups = await run.step(groups, "pipelined", next_name=model.get_inference_name())
            assert groups, "no rollouts were gathered while the step trained"
        listed = {m.id for m in (await run.client.models.list()).data}
        last = SYNCHRONOUS_STEPS + PIPELINED_STEPS
        assert {f"agent@{step}" for step in range(last - 1, last + 1)} <= listed, listed
        launched = [p for p in psutil.Process().children(recursive=True) if p.pid not in already]
        trainer = backend.trainer(model)
        ranks = list(trainer.info["pids"])
    finally:
        await backend.close()
    # Nothing left: every process the backend started has exited, and none holds GPU memory.
    _, alive = psutil.wait_procs(launched, timeout=30)
    assert alive == [], [(p.pid, p.name()) for p in alive]
    ours = {p.pid for p in launched}
    assert not [app for app in compute_apps() if app[0] in ours]
    assert len(ranks) == 3 and set(ranks) <= ours
    (log,) = tmp_path.rglob("trainer.log")
    assert "torch.distributed.run" in log.read_text()
    record("four-gpu/steps", model=four_gpu_model, layout=described, steps=run.steps,
           gpu_mib_before=before, gpu_mib_after_close=gpu_used_mib(),
           processes_started=len(launched))  # fmt: skip
