"""The training of `common.train_loop`, pipelined with ART's `PipelineTrainer` (openpipe-art installed):
rollout workers keep sampling on older steps (at most `max_steps_off_policy` behind) while `train()`
runs, instead of gather → train → gather. Same scenarios in the same order and the same sampling seeds
as the synchronous loop, so the two compare step for step.

PipelineTrainer keeps its bound by discarding: its workers wait for a newer policy only with
`max_steps_off_policy=0`, so what limits how far they run ahead is its output queue plus the groups the
workers hold. When rollouts are faster than training every slot fills, and a group reaches the trainer
as many steps old as that depth holds batches; beyond the bound it was sampled for nothing (40 of 96
groups with ART's default queue and two batches of workers, bench-pipeline-replicas on 4 H200s). The
loop sizes workers plus queue to `max_steps_off_policy` batches (`_pipeline_depth`): then only a
rollout that outlasts a training step can fall behind the bound and be discarded.

Needs a backend whose server keeps serving while the trainer trains: split mode, the CPU reference
engine, or one GPU with `shared_strategy="co_resident"`; and ART's own `TrainableModel` (PipelineTrainer
keeps its state with it).
"""

from __future__ import annotations

import asyncio
import itertools
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
        trained_from = result.step - 1
        names = sorted({name for t in trajectories for name in t.metrics})
        report = StepReport(
            trained_from,
            [t.reward for t in trajectories],
            # Rollouts run all the time here: what the trainer waited for them since its last step.
            max(started - self._previous_end, 0.0),
            result.metrics.get("time/step_s", time.monotonic() - started),
            {n: statistics.fmean(float(t.metrics[n]) for t in trajectories if n in t.metrics) for n in names},
            dict(result.metrics),
            # PipelineTrainer's own `steps_off_policy` counts from the step the batch produces (an
            # on-policy batch: 1); its bound, as the backend's, counts from the step it trains.
            steps_behind=[
                trained_from - min(t.initial_policy_version for t in g.trajectories) for g in groups
            ],
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
    (default: one step's worth, one fewer with `max_steps_off_policy=1`)."""
    art = openpipe_art()
    from art.pipeline_trainer import PipelineTrainer

    start = await model.get_step()

    async def scenarios() -> AsyncIterator[dict[str, Any]]:
        # The synchronous loop's scenarios of round k are env.scenarios(model step, ...): the same here,
        # without end: PipelineTrainer stops at `max_steps`, however many groups it discarded (zero
        # variance) on the way. (A stream that ends while its queue is full and the last step is trained
        # leaves ART 0.5.18's rollout stage waiting forever to queue its end marker.)
        for round_ in itertools.count():
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
    workers, queue = _pipeline_depth(groups_per_step, max_steps_off_policy, rollout_workers)
    trainer = PipelineTrainer(
        model,
        recording,  # type: ignore[arg-type]
        rollout,
        scenarios(),
        None,
        num_rollout_workers=workers,
        min_batch_size=groups_per_step,
        max_batch_size=groups_per_step,
        max_steps_off_policy=max_steps_off_policy,
        queue_maxsize=queue,
        learning_rate=learning_rate,
        max_steps=steps,
        log_interval_seconds=3600,
    )
    await trainer.train(handle_signals=False)
    return recording.reports


def _pipeline_depth(batch: int, max_steps_off_policy: int, workers: int | None) -> tuple[int, int]:
    """PipelineTrainer's rollout workers and output queue size for batches of `batch` groups: together at
    most `max_steps_off_policy` batches, with at most one batch of workers. A group sampled on step v that
    no later group overtakes has at most workers - 1 + queue groups ahead of it, so the trainer takes it
    by its batch from step v + (those // batch) + 1: within the bound when those < bound * batch. (ART's
    default queue alone is bound * batch, so any worker overran it.) With a bound of 0 the workers wait for
    each new policy themselves: one batch of them, and ART's own queue of one."""
    if max_steps_off_policy == 0:
        return workers or batch, 1
    depth = max(max_steps_off_policy * batch, 2)
    workers = workers or max(1, min(batch, depth - 1))
    return workers, max(1, depth - workers)
