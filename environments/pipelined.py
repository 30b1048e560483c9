"""The training of `common.train_loop`, pipelined with ART's `PipelineTrainer` (openpipe-art installed):
rollout workers keep sampling on older steps (at most `max_steps_off_policy` behind) while `train()`
runs, instead of gather → train → gather. Same scenarios in the same order and the same sampling seeds
as the synchronous loop, so the two compare step for step.

Needs a backend whose server keeps serving while the trainer trains: split mode, the CPU reference
engine, or one GPU with `shared_strategy="co_resident"`; and ART's own `TrainableModel` (PipelineTrainer
keeps its state with it).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from .environment import Environment, StepReport, rollout_seed


def openpipe_art() -> Any:
    """The `art` package (openpipe-art), imported without its network look-up of LiteLLM's cost map."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import art

    return art


class _RecordingBackend:
    """The backend as PipelineTrainer sees it, recording each `train()` call's batch as a `StepReport`."""

    def __init__(self, backend: Any, on_step: Callable[[StepReport], None] | None) -> None:
        self._backend = backend
        self._on_step = on_step
        self._previous_end = time.monotonic()
        self.reports: list[StepReport] = []

    async def train(self, model: Any, groups: Any, **options: Any) -> Any:
        groups = list(groups)
        started = time.monotonic()
        result = await self._backend.train(model, groups, **options)
        trajectories = [t for g in groups for t in g.trajectories]
        names = sorted({name for t in trajectories for name in t.metrics})
        report = StepReport(
            result.step - 1,
            [t.reward for t in trajectories],
            # Rollouts run all the time here: what the trainer waited for them since its last step.
            max(started - self._previous_end, 0.0),
            result.metrics.get("time/step_s", time.monotonic() - started),
            {n: statistics.fmean(float(t.metrics[n]) for t in trajectories if n in t.metrics) for n in names},
            dict(result.metrics),
        )
        self._previous_end = time.monotonic()
        self.reports.append(report)
        if self._on_step is not None:
            self._on_step(report)
        return result

    def adapter_lease(self, model: Any, step: int) -> AbstractAsyncContextManager[None]:
        return self._backend.adapter_lease(model, step)

    async def prune_model_adapters(self, model: Any, *, retain_steps: set[int]) -> None:
        await self._backend.prune_model_adapters(model, retain_steps=retain_steps)

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        await self._backend._delete_checkpoint_files(model, steps_to_keep)


async def pipelined_loop(
    backend: Any,
    model: Any,
    env: Environment,
    *,
    steps: int,
    groups_per_step: int = 8,
    group_size: int = 8,
    learning_rate: float,
    seed: int = 0,
    max_steps_off_policy: int = 2,
    rollout_workers: int | None = None,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """`steps` training steps of `groups_per_step` groups each, with ART's PipelineTrainer on `model`
    (ART's TrainableModel, registered with `backend`). `rollout_workers` groups are sampled at once
    (default: two steps' worth)."""
    art = openpipe_art()
    from art.pipeline_trainer import PipelineTrainer

    start = await model.get_step()

    async def scenarios() -> AsyncIterator[dict[str, Any]]:
        # The synchronous loop's scenarios of round k are env.scenarios(model step, ...): the same here,
        # with room for the groups a run takes beyond its last step.
        for round_ in range(steps + max_steps_off_policy + 2):
            for group, scenario in enumerate(env.scenarios(start + round_, groups_per_step, seed)):
                yield {"scenario": scenario, "round": round_, "group": group}

    async def rollout(model: Any, item: dict[str, Any], config: Any) -> Any:
        seeds = [rollout_seed(seed, item["round"], item["group"], i) for i in range(group_size)]
        trajectories = await asyncio.gather(*(env.rollout(model, item["scenario"], s) for s in seeds))
        # PipelineTrainer takes ART's own types; the environments build art_sglang's (the same fields).
        return art.TrajectoryGroup(
            art.Trajectory(
                messages_and_choices=t.messages_and_choices,
                reward=t.reward,
                metrics=t.metrics,
                metadata=t.metadata,
            )
            for t in trajectories
        )

    recording = _RecordingBackend(backend, on_step)
    trainer = PipelineTrainer(
        model,
        recording,  # type: ignore[arg-type]
        rollout,
        scenarios(),
        None,
        num_rollout_workers=rollout_workers or 2 * groups_per_step,
        min_batch_size=groups_per_step,
        max_batch_size=groups_per_step,
        max_steps_off_policy=max_steps_off_policy,
        learning_rate=learning_rate,
        max_steps=steps,
        log_interval_seconds=3600,
    )
    await trainer.train(handle_signals=False)
    return recording.reports
