"""Group-relative advantages: each trajectory's reward minus its group's mean, optionally divided by the
group's (population) reward std. A group whose rewards are all equal carries no signal and is skipped."""

from __future__ import annotations

import math
from dataclasses import dataclass

STD_EPS = 1e-6


@dataclass
class Advantages:
    """Per group: the trajectories' advantages, or None for a skipped (zero-variance) group."""

    per_group: list[list[float] | None]

    @property
    def groups_skipped(self) -> int:
        return sum(a is None for a in self.per_group)

    @property
    def groups_trained(self) -> int:
        return len(self.per_group) - self.groups_skipped


def group_advantages(rewards: list[list[float]], *, scale_rewards: bool) -> Advantages:
    per_group: list[list[float] | None] = []
    for group in rewards:
        if not group or max(group) == min(group):
            per_group.append(None)
            continue
        mean = sum(group) / len(group)
        centred = [r - mean for r in group]
        if scale_rewards:
            std = math.sqrt(sum(c * c for c in centred) / len(group))
            centred = [c / (std + STD_EPS) for c in centred]
        per_group.append(centred)
    return Advantages(per_group)
