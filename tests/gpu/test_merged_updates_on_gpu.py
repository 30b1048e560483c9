"""Rollouts in flight across a merged-weight update on real SGLang (docs/merged-rollouts.md section 6):
one GPU, server and trainer co-resident (no handoff, so rollouts run while train() runs), merged weights. A
long whole and a long streamed rollout started before a step come back each as one complete choice whose
runs of tokens name the weights that sampled them, and train() takes them (max_steps_off_policy=1).

    pytest -m gpu tests/gpu/test_merged_updates_on_gpu.py      (~4 min)
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from gpu_helpers import PROMPTS, make_groups, record, sglang_test_config

from art_sglang import SGLangBackend, TrainableModel, TrainerConfig, Trajectory, TrajectoryGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import choice_of_stream

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

LONG = 4000  # tokens: still being sampled when the step's push comes (a step takes seconds)
VERSIONS = "art_weight_versions"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    root = tmp_path_factory.mktemp("merged-in-flight")
    config = sglang_test_config(weight_sync_method="merged", max_steps_off_policy=1, mem_fraction_static=0.3)
    backend = SGLangBackend(
        engine="sglang", inference_device=0, training_devices=[0], shared_strategy="co_resident",
        sglang_config=config, trainer_config=TrainerConfig(use_unsloth=False), path=str(root / ".art"),
    )  # fmt: skip
    model = TrainableModel(name="agent", project="gpu-merged-in-flight", base_model=gpu_model)
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


def _ask(model: TrainableModel, **extra: Any) -> Any:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    return model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=LONG, logprobs=True, **extra
    )


async def _whole(model: TrainableModel) -> Any:
    return (await _ask(model, extra_body={"ignore_eos": True})).choices[0]


async def _streamed(model: TrainableModel) -> Any:
    stream = await _ask(model, stream=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    return await choice_of_stream(stream, VERSIONS)


async def test_rollouts_across_a_step_are_continued_on_the_new_weights(run) -> None:
    backend, model = run
    client = model.openai_client()
    groups = await make_groups(client, model.get_inference_name())
    rollouts = [asyncio.create_task(_whole(model)), asyncio.create_task(_streamed(model))]
    await asyncio.sleep(2.0)
    assert not any(r.done() for r in rollouts), "the rollouts ended before the step: raise LONG"
    started = time.monotonic()
    result = await backend.train(model, groups, learning_rate=0.02)
    step_s = time.monotonic() - started
    assert result.step == 1
    whole, streamed = await asyncio.wait_for(asyncio.gather(*rollouts), 600)
    for choice in (whole, streamed):
        spans = getattr(choice, VERSIONS)
        assert [s["version"] for s in spans] == ["agent@0", "agent@1"], spans
        assert sum(s["tokens"] for s in spans) == LONG == len(choice.logprobs.content)
        assert choice.finish_reason == "length"
    assert len(whole.token_ids) == LONG
    record(
        "merged-in-flight",
        step_s=step_s,
        whole=getattr(whole, VERSIONS),
        streamed=getattr(streamed, VERSIONS),
    )
    messages = [{"role": "user", "content": PROMPTS[0]}]
    taken = TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[*messages, c], reward=float(i))
            for i, c in enumerate((whole, streamed))
        ]
    )
    assert (await backend.train(model, [taken], learning_rate=0.02)).step == 2
