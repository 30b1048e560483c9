"""Steps that must not be published as they are, through a real backend (reference engine + trainer worker
on CPU; one backend for the module, the tests run in order): a step whose adapter cannot serve rollouts
(absurd learning rate: finite loss, gradients and weights, but logprobs that are not) is refused and rolled
back; a trainer that hangs after saving a step is noticed within a bound derived from its own step times
(not the hour of `step_timeout`), and the error names the saved step and the step that will be served."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import pytest_asyncio
from backend_helpers import sample_groups

import art_sglang as art
from art_sglang import SGLangBackend, TrainerError, TrainingError
from art_sglang.storage.history import read_rows
from art_sglang.storage.model_store import ModelStore

pytestmark = pytest.mark.asyncio(loop_scope="module")

TRAIN = {"learning_rate": 1e-3, "allow_training_without_logprobs": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def refusing(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    path = tmp_path_factory.mktemp("refused") / ".art"
    backend = SGLangBackend(path=str(path))
    model = art.TrainableModel(name="agent", project="refused", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield backend, model, ModelStore(path, "refused", "agent")
    finally:
        await backend.close()


async def _signal_groups(model: art.TrainableModel, seed: int) -> list[art.TrajectoryGroup]:
    """Rollouts of the current step with rewards that differ within each group, so the step trains."""
    groups = await sample_groups(model, seed=seed)
    return [
        art.TrajectoryGroup(
            [t.model_copy(update={"reward": float(i % 2)}) for i, t in enumerate(group.trajectories)]
        )
        for group in groups
    ]


async def _logprobs(model: art.TrainableModel, name: str) -> list[float]:
    """What a rollout asks of step `name`: a completion with logprobs, through the model's client."""
    completion = await model.openai_client().chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=4, logprobs=True
    )
    assert completion.choices[0].logprobs is not None and completion.choices[0].logprobs.content
    return [token.logprob for token in completion.choices[0].logprobs.content]


async def test_a_step_whose_adapter_cannot_serve_is_refused(refusing) -> None:
    backend, model, store = refusing
    groups = await _signal_groups(model, seed=1)
    with pytest.raises(TrainingError, match=r"learning_rate=1e\+30") as refused:
        await backend.train(model, groups, **{**TRAIN, "learning_rate": 1e30})
    assert "step 1 " in str(refused.value) and "Step 0 stays served" in str(refused.value)
    # Not published, not on disk; the previous step answers what rollouts ask.
    assert await model.get_step() == 0 and model.get_inference_name() == "agent@0"
    assert store.checkpoint_steps() == [0] and list(store.checkpoints_dir.glob("0001.broken-*"))
    assert all(-1e9 < lp <= 0 for lp in await _logprobs(model, "agent@0"))
    # The next step trains from step 0 and is served.
    result = await backend.train(model, await _signal_groups(model, seed=2), **TRAIN)
    assert result.step == 1 and result.metrics["gradient_steps"] > 0
    assert all(-1e9 < lp <= 0 for lp in await _logprobs(model, "agent@1"))


async def test_a_trainer_hung_after_saving_a_step_is_noticed_from_its_step_times(refusing) -> None:
    backend, model, store = refusing
    trainer = backend.trainer(model)
    step = await model.get_step()
    assert step >= 1 and trainer.pid is not None
    longest = max(row["time/train_s"] for row in read_rows(store.history) if "time/train_s" in row)
    # The trainer wrote checkpoint step+1, then hung before reporting it.
    shutil.copytree(store.checkpoint_dir(step), store.checkpoint_dir(step + 1))
    os.kill(trainer.pid, signal.SIGSTOP)
    began = time.monotonic()
    with pytest.raises(TrainerError, match="sent nothing for") as hung:
        await backend.train(model, await _signal_groups(model, seed=3), **TRAIN)
    waited = time.monotonic() - began
    # Ten times its longest step (at least 10 s) and the kill, far below step_timeout's hour.
    assert waited < max(10 * longest, 10) + 20 < trainer.config.step_timeout, (waited, longest)
    message = str(hung.value)
    assert f"Step {step + 1} was saved before that" in message, message
    assert f"publishes step {step + 2}; step {step} stays served" in message, message
    assert model.get_inference_name() == f"agent@{step}"
    # As the error says: the next step resumes the saved one and publishes step+2.
    result = await backend.train(model, await _signal_groups(model, seed=4), **TRAIN)
    assert result.step == step + 2 and model.get_inference_name() == f"agent@{step + 2}"
