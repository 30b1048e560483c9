"""ART's `PipelineTrainer` runs unchanged on SGLangBackend (CPU reference engine): rollouts keep running
while `train()` runs, every rollout is served by the adapter of the step it leased (never a 404, never
an on-demand reload of an unloaded step), the staleness is recorded, and a second run resumes the step
and the scenario stream where the first stopped. The first run shares one device co-resident (no
handoff), the second has the CPU layout. (The refusal of a handoff mode is in
tests/backend/test_backend_shared_mode.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.planning.devices import DeviceLayout

GROUP_SIZE = 3
MAX_TOKENS = 8
PROMPTS = [f"Say something about the number {n}." for n in range(60)]


class Recorder:
    """What the run did, seen from the rollouts and from `train()` calls (timestamps from one clock)."""

    def __init__(self) -> None:
        self.rollouts: list[dict[str, Any]] = []
        self.trains: list[tuple[float, float, int]] = []
        self.trained_on: list[tuple[int | None, str]] = []  # (leased step, model that answered)
        self.errors: list[BaseException] = []
        self.taken: list[int] = []  # scenario indices, as rollouts begin

    def rollout_fn(self, ART: Any) -> Any:
        async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
            started = time.monotonic()
            self.taken.append(scenario["index"])
            asked = model.get_inference_name()
            client = model.openai_client()
            try:
                responses = await asyncio.gather(
                    *(
                        client.chat.completions.create(
                            model=asked,
                            messages=[{"role": "user", "content": scenario["prompt"]}],
                            max_tokens=MAX_TOKENS,
                            temperature=1.0,
                            logprobs=True,
                            seed=scenario["index"] * 10 + i,
                            extra_body={"return_token_ids": True},
                        )
                        for i in range(GROUP_SIZE)
                    )
                )
            except BaseException as exc:
                self.errors.append(exc)
                raise
            self.rollouts.append(
                {"index": scenario["index"], "asked": asked, "start": started, "end": time.monotonic()}
            )
            return ART.TrajectoryGroup(
                ART.Trajectory(
                    messages_and_choices=[{"role": "user", "content": scenario["prompt"]}, r.choices[0]],
                    # Distinct rewards, so no group is discarded for zero variance.
                    reward=float(i) + len(r.choices[0].message.content or "") / 100,
                    metadata={"served": r.model},
                )
                for i, r in enumerate(responses)
            )

        return rollout

    def wrap_train(self, backend: SGLangBackend) -> None:
        """Record each call of `backend.train` (the instance's; PipelineTrainer calls it)."""
        train = backend.train

        async def recording_train(model: Any, groups: Any, **options: Any) -> Any:
            groups = list(groups)
            self.trained_on += [
                (t.initial_policy_version, t.metadata["served"]) for g in groups for t in g.trajectories
            ]
            started = time.monotonic()
            result = await train(model, groups, **options)
            self.trains.append((started, time.monotonic(), result.step))
            return result

        backend.train = recording_train  # type: ignore[method-assign]


def pipeline(ART: Any, model: Any, backend: SGLangBackend, recorder: Recorder, **options: Any) -> Any:
    from art.pipeline_trainer import PipelineTrainer

    return PipelineTrainer(
        model,
        backend,
        recorder.rollout_fn(ART),
        [{"prompt": prompt, "index": index} for index, prompt in enumerate(PROMPTS)],
        None,
        num_rollout_workers=4,
        min_batch_size=2,
        max_batch_size=2,
        max_steps_off_policy=2,
        learning_rate=1e-2,
        log_interval_seconds=3600,
        eval_fn=None,
        **options,
    )


async def test_pipeline_trainer_overlaps_rollouts_with_training_and_resumes(
    ART, tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="art_sglang")
    path = tmp_path / ".art"
    config = SGLangConfig(max_steps_off_policy=2)
    assert config.max_loras_per_batch == 4  # >= 3 steps at once; the default was already enough

    first = Recorder()
    shared = DeviceLayout("shared", "reference", (), (), "forced on CPU for the test")
    async with SGLangBackend(
        path=str(path), sglang_config=config, layout=shared, shared_strategy="co_resident"
    ) as backend:
        assert backend.handoff_strategy == "none"
        model = ART.TrainableModel(name="pipe", project="pipeline", base_model=str(tiny_model_path))
        await model.register(backend)
        first.wrap_train(backend)
        await pipeline(ART, model, backend, first, max_steps=3).train(handle_signals=False)
        assert await model.get_step() == 3
        # A step pruned while a rollout still leased it is unloaded once that lease ends, in a task of its
        # own: wait for it (on a loaded machine the last prune met a leased step).
        gateway = backend.inference.gateway
        for _ in range(200):
            if "pipe@0" not in gateway.served:
                break
            await asyncio.sleep(0.05)
        served_after = set(gateway.served)
        offset = model.read_state()["_pipeline_trainer"]["scenario_offset"]

    assert first.errors == []
    assert [step for _, _, step in first.trains] == [1, 2, 3]
    # Every trajectory was answered by the adapter of the step its rollout leased.
    assert first.trained_on and all(served == f"pipe@{step}" for step, served in first.trained_on)
    assert all(r["asked"].startswith("pipe@") for r in first.rollouts)
    # No leased step had been unloaded and had to be loaded again on request.
    assert not [r for r in caplog.records if "on request" in r.getMessage()]
    # Rollouts ran while train() ran: some started during a training step and some ran on an older step.
    during = [r for r in first.rollouts for s, e, _ in first.trains if s < r["start"] < e]
    assert during, (first.trains, [(r["start"], r["end"]) for r in first.rollouts])
    # Adapters of steps no rollout may use any more were unloaded (PipelineTrainer's prune).
    assert "pipe@3" in served_after and "pipe@0" not in served_after
    # PipelineTrainer's staleness metric is in the run's history.
    history = [
        json.loads(line) for line in (path / "pipeline/models/pipe/history.jsonl").read_text().splitlines()
    ]
    assert {row["step"] for row in history if "train/steps_off_policy" in row} == {1, 2, 3}

    # A second run resumes the step and the scenario stream.
    second = Recorder()
    async with SGLangBackend(path=str(path), sglang_config=config) as backend:
        model = ART.TrainableModel(name="pipe", project="pipeline", base_model=str(tiny_model_path))
        await model.register(backend)
        assert await model.get_step() == 3
        second.wrap_train(backend)
        await pipeline(ART, model, backend, second, max_steps=1).train(handle_signals=False)
        assert await model.get_step() == 4
    assert second.errors == []
    assert [step for _, _, step in second.trains] == [4]
    # Scenarios taken by the first run (trained on or cut off at its stop) are not taken again.
    assert max(first.taken) < offset == min(second.taken)


async def test_pipeline_trainer_runs_on_merged_weights(ART, tmp_path: Path, tiny_model_path: Path) -> None:
    """weight_sync_method="merged" serves one step's weights: rollouts on the older steps a lease pins (up
    to max_steps_off_policy) are answered by the newest weights, and each choice says which weights sampled
    its tokens; a rollout cut by a step's push is continued on the new weights."""
    config = SGLangConfig(weight_sync_method="merged", max_steps_off_policy=2)
    recorder = Recorder()
    spans: list[tuple[int | None, list[dict[str, Any]], int]] = []  # (leased step, spans, sampled ids)
    shared = DeviceLayout("shared", "reference", (), (), "forced on CPU for the test")
    async with SGLangBackend(
        path=str(tmp_path / ".art"), sglang_config=config, layout=shared, shared_strategy="co_resident"
    ) as backend:
        model = ART.TrainableModel(name="pipe", project="pipeline", base_model=str(tiny_model_path))
        await model.register(backend)
        recorder.wrap_train(backend)
        train = backend.train

        async def noting_train(model: Any, groups: Any, **options: Any) -> Any:
            groups = list(groups)
            for trajectory in (t for g in groups for t in g.trajectories):
                choice = trajectory.messages_and_choices[-1]
                versions = choice.model_extra["art_weight_versions"]
                spans.append((trajectory.initial_policy_version, versions, len(choice.token_ids)))
            return await train(model, groups, **options)

        backend.train = noting_train  # type: ignore[method-assign]
        await pipeline(ART, model, backend, recorder, max_steps=3).train(handle_signals=False)
        assert await model.get_step() == 3

    assert recorder.errors == []
    assert [step for _, _, step in recorder.trains] == [1, 2, 3]
    during = [r for r in recorder.rollouts for s, e, _ in recorder.trains if s < r["start"] < e]
    assert during  # rollouts went on while train() ran
    assert spans
    for leased, versions, sampled in spans:
        steps = [int(span["version"].removeprefix("pipe@")) for span in versions]
        assert leased is not None and all(leased <= step <= 3 for step in steps), (leased, versions)
        assert sum(span["tokens"] for span in versions) == sampled
