"""An OpenPipe ART program (openpipe-art installed: its own TrainableModel, Trajectory, TrajectoryGroup
and gather_trajectory_groups) swaps only the backend: it trains 2 steps through SGLangBackend on CPU, and a
new backend resumes it at step 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import AsyncOpenAI

from art_sglang import SGLangBackend


@pytest.fixture
def ART(openpipe_art):
    return openpipe_art


def _client(model) -> AsyncOpenAI:
    # ART 0.5.18's own model.openai_client() passes an `httpx.Timeout` to the `openai` client, which
    # openai 3.x (built on httpx2) cannot use, so the program builds its client from the model's fields,
    # which register() filled in exactly as ART's LocalBackend does.
    return AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)


async def _rollout(ART, model, client: AsyncOpenAI, seed: int):
    messages = [{"role": "user", "content": "Say something."}]
    reply = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6, logprobs=True, seed=seed
    )
    choice = reply.choices[0]
    text = choice.message.content or ""
    reward = sum(c in "aeiou" for c in text) / max(len(text), 1)
    return ART.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


async def test_art_program_trains_and_resumes(ART, tmp_path: Path, tiny_model_path: Path) -> None:
    path = str(tmp_path / ".art")
    model = ART.TrainableModel(name="art-agent", project="art-compat", base_model=str(tiny_model_path))
    backend = SGLangBackend(path=path)
    try:
        await model.register(backend)
        assert model.get_inference_name() == "art-agent@0"
        client = _client(model)
        for step in (1, 2):
            groups = await ART.gather_trajectory_groups(
                (ART.TrajectoryGroup(_rollout(ART, model, client, seed=step * 100 + g * 10 + i) for i in range(4))
                 for g in range(2)),
                pbar_desc=None,
            )  # fmt: skip
            result = await backend.train(model, groups, learning_rate=1e-3)
            assert result.step == step and await model.get_step() == step
            assert model.get_inference_name() == f"art-agent@{step}"
        # ART writes its own history rows (metrics only: its trajectory files need pyarrow, not installed).
        await model.log(metrics=result.metrics, step=result.step, split="train")
        assert (tmp_path / ".art" / "art-compat" / "models" / "art-agent" / "history.jsonl").exists()
    finally:
        await backend.close()

    again = ART.TrainableModel(name="art-agent", project="art-compat", base_model=str(tiny_model_path))
    async with SGLangBackend(path=path) as resumed:
        await again.register(resumed)
        assert await again.get_step() == 2 and again.get_inference_name() == "art-agent@2"
        reply = await _client(again).chat.completions.create(
            model=again.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.model == "art-agent@2"
