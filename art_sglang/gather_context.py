"""The progress and exception accounting of one `gather_trajectory_groups` call, which the rollouts it
awaits (`PendingTrajectoryGroup`) report to."""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm.auto import tqdm


class Scored(Protocol):
    """What the running means read of a finished rollout (a `Trajectory`, which imports this module)."""

    reward: float
    metrics: Mapping[str, float | int | bool]


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

    def record_trajectories(self, trajectories: Iterable[Scored], advance: int | None = None) -> None:
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


# The gather call a rollout runs in (each task copies the context it was created in).
CURRENT: contextvars.ContextVar[GatherContext] = contextvars.ContextVar("art_sglang_gather_context")


def current_gather_context() -> GatherContext:
    """The context of the enclosing gather call; outside one, a fresh context where any exception raises."""
    try:
        return CURRENT.get()
    except LookupError:
        return GatherContext()
