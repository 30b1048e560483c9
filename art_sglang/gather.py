"""`gather_trajectory_groups`: run many rollout groups concurrently behind one progress bar (as ART does)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from tqdm.auto import tqdm

from .gather_context import CURRENT, GatherContext
from .trajectories import PendingTrajectoryGroup, TrajectoryGroup

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


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
    token = CURRENT.set(context)
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
        CURRENT.reset(token)
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
