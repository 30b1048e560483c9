"""An OpenPipe ART program in merged mode on real SGLang (issue 40's done-when): ART's own TrainableModel
with `_internal_config={"rollout_weights_mode": "merged"}`, the default (Unsloth) trainer, 3 RL steps of
rollouts gathered by ART, in shared mode (one GPU: the push by CUDA IPC) and split mode (server on GPU 0,
trainer on GPU 1: the push by NCCL). Every rollout's choice says which weights sampled it, the trainer
scores the sampled tokens as the merged server sampled them, and each step is served under its name.

    pytest -m gpu tests/gpu/test_art_program_merged.py        (~6 min on 2 GPUs; split skipped on 1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import record, sglang_test_config

from art_sglang import SGLangBackend

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "shared": (1, {"inference_device": 0, "training_devices": [0]}),
    "split": (2, {"inference_device": 0, "training_devices": [1]}),
}


async def episode(ART: Any, model: Any, seed: int) -> Any:
    """One rollout as ART writes it: a question, the model's answer (logprobs on), a reward that varies
    with the seed; the choice's weight versions are checked against the step it was asked of."""
    question = [{"role": "user", "content": f"Count from {seed} to {seed + 5}."}]
    name = model.get_inference_name()
    answer = await model.openai_client().chat.completions.create(
        model=name, messages=question, max_tokens=24, logprobs=True, seed=seed
    )
    choice = answer.choices[0]
    spans = choice.model_extra["art_weight_versions"]
    assert [span["version"] for span in spans] == [name]
    assert sum(span["tokens"] for span in spans) == answer.usage.completion_tokens
    return ART.Trajectory(messages_and_choices=[*question, choice], reward=float(seed % 3))


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_an_art_program_trains_three_steps_on_merged_weights(
    openpipe_art, gpu_model: str, gpu_count: int, tmp_path: Path, layout: str
) -> None:
    ART = openpipe_art
    needed, devices = LAYOUTS[layout]
    if gpu_count < needed:
        pytest.skip(f"{layout} needs {needed} GPUs, {gpu_count} visible")
    model = ART.TrainableModel(
        name="art-merged",
        project="art-merged",
        base_model=gpu_model,
        _internal_config=ART.dev.InternalModelConfig(rollout_weights_mode="merged"),
    )
    backend = SGLangBackend(path=str(tmp_path / ".art"), sglang_config=sglang_test_config(), **devices)
    try:
        await model.register(backend)
        assert backend.layout.mode == layout
        assert backend.sglang_config.weight_sync_method == "merged"
        for step in (1, 2, 3):
            groups = await ART.gather_trajectory_groups(
                (
                    ART.TrajectoryGroup(episode(ART, model, seed=10 * g + i) for i in range(4))
                    for g in range(2)
                ),
                pbar_desc=None,
            )
            result = await backend.train(model, groups, learning_rate=1e-4)
            record(f"art_program_merged/{layout}", step=result.step, metrics=result.metrics)
            assert result.step == step and model.get_inference_name() == f"art-merged@{step}"
            # The trainer's bf16 LoRA forward against the server's merged bf16 weights: equal up to rounding.
            assert abs(result.metrics["ratio_mean"] - 1) < 0.02
    finally:
        await backend.close()
