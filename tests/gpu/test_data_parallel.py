"""Data-parallel training on two GPUs, one trainer rank per GPU (torch.distributed.run, NCCL): float32 peft
ranks give the one-GPU adapter; Unsloth ranks train, each on its own GPU; and the backend in shared mode
(a TP=2 server on GPUs 0,1, the only layout with two training ranks on two GPUs) trains a step with both
ranks and serves it.

    pytest -m gpu tests/gpu/test_data_parallel.py      (needs 2 GPUs; ~4 min)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import compute_apps, make_groups, record, sglang_test_config
from safetensors.torch import load_file

from art_sglang import SGLangBackend, TrainableModel
from art_sglang.config import TrainerConfig
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess

pytestmark = [pytest.mark.gpu]

OPTIONS = TrainOptions(learning_rate=1e-2, allow_training_without_logprobs=True)


@pytest.fixture(autouse=True)
def _two_gpus(gpu_count: int) -> None:
    if gpu_count < 2:
        pytest.skip(f"data parallelism needs 2 GPUs, {gpu_count} visible")


def batch() -> list[dict[str, Any]]:
    """Two groups of four answers of different lengths, every reward different: 8 trained sequences."""
    answers = [("one two three four five six seven", 1.0), ("a b", 0.0), ("x y z", 0.3), ("q", 0.6)]
    return [
        {
            "trajectories": [
                {
                    "messages_and_choices": [
                        {"role": "user", "content": f"Task {g}: say something."},
                        {"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": text * (g + 1)}},
                    ],
                    "reward": reward,
                }
                for text, reward in answers
            ]
        }
        for g in range(2)
    ]  # fmt: skip


def trainer(model: str, folder: Path, gpus: list[int], **config: Any) -> TrainerProcess:
    return TrainerProcess(
        model, folder / "checkpoints", TrainerConfig(**config), gpu_ids=gpus, log_path=folder / "trainer.log"
    )


def adapter(path: Path | None) -> dict[str, torch.Tensor]:
    assert path is not None
    return load_file(path / "adapter_model.safetensors")


async def test_two_float32_ranks_give_the_one_gpu_adapter(gpu_model: str, tmp_path: Path) -> None:
    one = trainer(gpu_model, tmp_path / "one", [0], use_unsloth=False, dtype="float32")
    two = trainer(gpu_model, tmp_path / "two", [0, 1], use_unsloth=False, dtype="float32")
    try:
        await asyncio.gather(one.start(), two.start())
        assert (one.info["ranks"], two.info["ranks"]) == (1, 2)
        expected = await one.train(batch(), OPTIONS)
        got = await two.train(batch(), OPTIONS)
    finally:
        await asyncio.gather(one.stop(), two.stop())
    a, b = adapter(expected.checkpoint_path), adapter(got.checkpoint_path)
    initial = adapter(tmp_path / "one/checkpoints/0000")
    moved = max(float((a[k] - initial[k]).abs().max()) for k in a)
    differs = max(float((a[k] - b[k]).abs().max()) for k in a)
    record(
        "ddp/float32-two-ranks-vs-one",
        largest_update=moved,
        largest_difference=differs,
        loss=(expected.metrics["loss"], got.metrics["loss"]),
    )
    assert moved > 1e-3
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-5)
    assert got.metrics["num_tokens"] == expected.metrics["num_tokens"]


async def test_unsloth_ranks_train_each_on_its_own_gpu(gpu_model: str, tmp_path: Path) -> None:
    two = trainer(gpu_model, tmp_path, [0, 1])
    try:
        await two.start()
        outcome = await two.train(batch(), OPTIONS)
        held = {pid: gpu for pid, gpu, _ in compute_apps()}
        gpus = sorted(held.get(pid, -1) for pid in two.info["pids"])
    finally:
        await two.stop()
    record("ddp/unsloth-two-ranks", backend=two.info["backend"], gpus=gpus, metrics=outcome.metrics)
    assert two.info["backend"] == "unsloth"
    assert gpus == [0, 1]
    assert outcome.trained and outcome.step == 1
    weights = adapter(outcome.checkpoint_path)
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


async def test_backend_in_shared_mode_trains_with_two_ranks(gpu_model: str, tmp_path: Path) -> None:
    backend = SGLangBackend(
        engine="sglang",
        inference_device=0,
        training_devices=[0, 1],
        sglang_config=sglang_test_config(tensor_parallel_size=2),
        path=str(tmp_path / ".art"),
    )
    assert backend.layout.mode == "shared"
    assert "training ranks 0 on GPU 0, 1 on GPU 1" in backend.layout.describe()
    model = TrainableModel(name="agent", project="gpu-ddp", base_model=gpu_model)
    try:
        await model.register(backend)
        client = model.openai_client()
        groups = await make_groups(client, "agent@0")
        result = await backend.train(model, groups, learning_rate=0.02)
        assert result.step == 1 and model.get_inference_name() == "agent@1"
        answer = await client.chat.completions.create(
            model="agent@1", messages=[{"role": "user", "content": "Say something."}], max_tokens=8
        )
        assert answer.choices[0].message.content is not None
    finally:
        await backend.close()
    (log,) = tmp_path.rglob("trainer.log")
    assert "torch.distributed.run" in log.read_text()
    record("ddp/backend-shared-two-ranks", metrics={k: v for k, v in result.metrics.items() if "time/" in k})
