"""`gather_trajectory_groups`: run many rollout groups concurrently behind one progress bar (as ART does)."""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .trajectories import PendingTrajectoryGroup, Trajectory, TrajectoryGroup

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


@dataclass
class GatherContext:
    """Progress and exception accounting shared by every rollout of one gather call."""

    pbar: tqdm | None = None
    total: int = 0
    max_exceptions: int | float = 0
    max_metrics: int | None = None
    sums: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    exceptions: int = 0

    def record_trajectories(self, trajectories: Iterable[Trajectory], advance: int | None = None) -> None:
        """Add finished trajectories to the running means; advance the bar (by their number by default)."""
        finished = list(trajectories)
        for trajectory in finished:
            self.sums["reward"] += trajectory.reward
            self.counts["reward"] += 1
            for name, value in trajectory.metrics.items():
                self.sums[name] += float(value)
                self.counts[name] += 1
        self._refresh(len(finished) if advance is None else advance)

    def count_exception(self) -> bool:
        """Count a failed rollout; True when the count now exceeds `max_exceptions` (re-raise it)."""
        self.exceptions += 1
        self._refresh(1)  # a failed rollout is finished too, so the bar still reaches its total
        if 0 < self.max_exceptions < 1:
            # A float below 1 is a share of all rollouts.
            return self.total == 0 or self.exceptions / self.total > self.max_exceptions
        return self.exceptions > self.max_exceptions

    def _refresh(self, advance: int) -> None:
        if self.pbar is None:
            return
        names = list(self.sums)[: self.max_metrics] if self.max_metrics is not None else list(self.sums)
        postfix: dict[str, Any] = {name: self.sums[name] / max(1, self.counts[name]) for name in names}
        if self.exceptions:
            postfix["exceptions"] = self.exceptions
        self.pbar.update(advance)
        self.pbar.set_postfix(postfix, refresh=False)


_current: contextvars.ContextVar[GatherContext] = contextvars.ContextVar("art_sglang_gather_context")


def current_gather_context() -> GatherContext:
    """The context of the enclosing gather call; outside one, a fresh context where any exception raises."""
    try:
        return _current.get()
    except LookupError:
        return GatherContext()


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Await all groups concurrently and return them in the given order.

    The bar counts rollouts (one per group awaitable that is not a `TrajectoryGroup(<awaitables>)`) and
    shows the running mean reward and metrics. A failing rollout is kept in its group's `exceptions`, a
    failing group awaitable is dropped; once failures exceed `max_exceptions` (a count, or a share of all
    rollouts when between 0 and 1) the failure is re-raised and the other rollouts are cancelled.
    `after_each` may replace a finished group with another, several, or none.
    """
    pending = list(groups)
    total = sum(g.size if isinstance(g, PendingTrajectoryGroup) else 1 for g in pending)
    context = GatherContext(
        pbar=tqdm(desc=pbar_desc, total=total),
        total=total,
        max_exceptions=max_exceptions,
        max_metrics=max_metrics,
    )
    # Set before the tasks are created: each task copies the current contextvars.
    token = _current.set(context)
    try:
        tasks = [asyncio.ensure_future(_finish_group(g, context, after_each)) for g in pending]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    finally:
        _current.reset(token)
        if context.pbar is not None:
            context.pbar.close()
    finished: list[TrajectoryGroup] = []
    for result in results:
        if isinstance(result, list):
            finished.extend(result)
        elif result is not None:
            finished.append(result)
    return finished


async def _finish_group(
    group: Awaitable[TrajectoryGroup] | TrajectoryGroup, context: GatherContext, after_each: AfterEach | None
) -> TrajectoryGroup | list[TrajectoryGroup] | None:
    if isinstance(group, TrajectoryGroup):
        context.record_trajectories(group, advance=1)
        done = group
    elif isinstance(group, PendingTrajectoryGroup):
        done = await group  # records each rollout itself as it finishes
    else:
        try:
            done = await group
        except Exception:
            if context.count_exception():
                raise
            return None
        context.record_trajectories(done, advance=1)
    return done if after_each is None else await after_each(done)
