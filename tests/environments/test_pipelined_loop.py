"""`environments.pipelined.pipelined_loop` drives ART's real PipelineTrainer; here on a paced stand-in for
the backend (`train()` takes a fixed time and advances the step) and an environment whose rollouts take a
fixed time, shorter than a step, as on the GPUs (2.5 s of rollouts against 4 s of training,
bench-pipeline-replicas, 2026-11-28). The loop trains every step asked for, never on a group more than
`max_steps_off_policy` steps behind the policy it trains, discards none for staleness, and samples the
next step's groups while the trainer trains."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # environments/ is a top-level folder of the checkout

import art_sglang as art  # noqa: E402
from environments.environment import StepReport  # noqa: E402
from environments.pipelined import pipelined_loop  # noqa: E402

TRAIN_S = 0.3
ROLLOUT_S = 0.15


class PacedBackend:
    """What PipelineTrainer calls on a backend: `train()` sleeps `TRAIN_S` and advances the step."""

    def __init__(self) -> None:
        self.step = 0
        self.trains: list[tuple[float, float]] = []

    async def register(self, model: Any) -> None:
        pass

    async def _prepare_backend_for_training(self, model: Any, config: Any) -> tuple[str, str]:
        return "http://127.0.0.1:9/v1", "unused"  # the paced environment sends no requests

    async def _get_step(self, model: Any) -> int:
        return self.step

    async def train(self, model: Any, groups: Any, **options: Any) -> Any:
        started = time.monotonic()
        await asyncio.sleep(TRAIN_S)
        self.step += 1
        self.trains.append((started, time.monotonic()))
        return SimpleNamespace(step=self.step, metrics={"time/step_s": TRAIN_S}, checkpoint_path=None)

    @contextlib.asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        yield

    async def prune_model_adapters(self, model: Any, *, retain_steps: set[int]) -> None:
        pass

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        pass


class PacedTask:
    """Rollouts that take `ROLLOUT_S` each, with rewards that vary within a group; records their starts."""

    name = "paced"
    max_tokens = 1

    def __init__(self) -> None:
        self.starts: list[float] = []

    def scenarios(self, step: int, count: int, seed: int) -> list[int]:
        return [step * count + i for i in range(count)]

    async def rollout(self, model: Any, scenario: int, seed: int) -> art.Trajectory:
        self.starts.append(time.monotonic())
        await asyncio.sleep(ROLLOUT_S)
        messages = [{"role": "user", "content": str(scenario)}, {"role": "assistant", "content": "x"}]
        return art.Trajectory(messages_and_choices=messages, reward=random.Random(seed).random())


async def paced_run(
    ART: Any, path: Path, steps: int, **options: Any
) -> tuple[list[StepReport], PacedBackend, PacedTask, list[float]]:
    """`steps` steps of 4 groups of 2 on the paced backend: the reports, the backend, the task, and each
    step's count of groups PipelineTrainer discarded as stale so far (from its history.jsonl)."""
    backend, task = PacedBackend(), PacedTask()
    model = ART.TrainableModel(name="paced", project="p", base_model="none", base_path=str(path))
    await model.register(backend)
    loop = pipelined_loop(
        backend, model, task, steps=steps, groups_per_step=4, group_size=2, learning_rate=1e-5, **options
    )
    reports = await asyncio.wait_for(loop, timeout=60)
    rows = map(json.loads, (path / "p/models/paced/history.jsonl").read_text().splitlines())
    discarded = [row["train/discarded_stale_groups"] for row in rows if "train/discarded_stale_groups" in row]
    return reports, backend, task, discarded


@pytest.mark.parametrize("max_steps_off_policy", [1, 2])
async def test_every_step_trains_within_the_bound_and_nothing_is_discarded_as_stale(
    openpipe_art: Any, tmp_path: Path, max_steps_off_policy: int
) -> None:
    reports, backend, task, discarded = await paced_run(
        openpipe_art, tmp_path, 8, max_steps_off_policy=max_steps_off_policy
    )
    assert [r.step for r in reports] == list(range(8)) and backend.step == 8
    assert all(len(r.rewards) == 4 * 2 for r in reports)
    # Steps behind: the policy a batch trains from less the policy that sampled each of its groups.
    assert all(len(r.steps_behind) == 4 for r in reports)
    assert max(b for r in reports for b in r.steps_behind) <= max_steps_off_policy
    assert discarded == [0.0] * 8
    # The next step's rollouts ran while the trainer trained.
    assert any(start < t < end for start, end in backend.trains[1:] for t in task.starts)


async def test_more_workers_than_the_bound_holds_are_discarded_never_trained(
    openpipe_art: Any, tmp_path: Path
) -> None:
    # Three batches of workers against a bound of one: rollouts run further ahead than the bound allows.
    reports, _, _, discarded = await paced_run(
        openpipe_art, tmp_path, 6, max_steps_off_policy=1, rollout_workers=12
    )
    assert len(reports) == 6
    assert max(b for r in reports for b in r.steps_behind) <= 1
    # ... because PipelineTrainer discarded the groups that fell further behind.
    assert discarded[-1] > 0


async def test_on_policy_the_groups_of_a_step_are_sampled_at_once(openpipe_art: Any, tmp_path: Path) -> None:
    """`max_steps_off_policy=0`: ART's workers wait for each new policy themselves, so the loop still gives
    them one batch of workers and a step's groups are sampled side by side, not one after another."""
    reports, backend, task, _ = await paced_run(openpipe_art, tmp_path, 3, max_steps_off_policy=0)
    assert [r.step for r in reports] == [0, 1, 2] and backend.step == 3
    assert all(len(r.rewards) == 4 * 2 and max(r.steps_behind) == 0 for r in reports)
    first_step = sorted(task.starts)[: 4 * 2]  # the first batch: 4 groups of 2
    assert first_step[-1] - first_step[0] < ROLLOUT_S / 2
