"""Advantages and token weights as ART 0.5.18 computes them (preprocessing/tokenize.py and pack.py).

1. Per group: advantage = reward − group mean, divided by (group population std + 1e-6) when
   scale_rewards. A group whose rewards are all equal carries no signal and is skipped (ART relies on the
   difference being exactly 0; here equal means equal, so float rounding cannot leave a ~1e-17 advantage
   that step 3 would scale up). Trajectories whose advantage is 0 are dropped.
2. Each trajectory's tokens get the weight 1 / (its sampled tokens + 1e-6): every trajectory counts
   the same, whatever its length. Over the batch's sampled tokens the weights are scaled to mean 1.
3. advantage_balance b > 0 multiplies negative advantages by (1 − b), b < 0 positive ones by (1 + b);
   then the advantages are divided by the token-mean of |advantage| · weight over the batch.

All of it in float64, so rewards of any finite size give finite advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenize import TokenizedSequence

STD_EPS = 1e-6
WEIGHT_EPS = 1e-6


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


def trajectory_weight(sampled_tokens: int) -> float:
    return 1 / (sampled_tokens + WEIGHT_EPS)


@dataclass
class TokenScale:
    """What the batch normalization did: weight ← weight · weight_scale; advantage ← balanced advantage ·
    advantage_scale. `advantage_scale` is None when no token carries a non-zero balanced advantage."""

    weight_scale: float
    advantage_scale: float | None


def balance(advantage: float, advantage_balance: float) -> float:
    if advantage_balance > 0 and advantage <= 0:
        return advantage * (1 - advantage_balance)
    if advantage_balance < 0 and advantage >= 0:
        return advantage * (1 + advantage_balance)
    return advantage


def batch_scale(items: list[tuple[int, float, float]], *, advantage_balance: float) -> TokenScale:
    """`items`: (sampled tokens, advantage, weight) per sequence of the batch."""
    tokens = sum(n for n, _, _ in items)
    weight_scale = tokens / sum(n * w for n, _, w in items)
    magnitude = sum(n * abs(balance(a, advantage_balance)) * w * weight_scale for n, a, w in items) / tokens
    return TokenScale(weight_scale, 1 / magnitude if magnitude > 0 and math.isfinite(magnitude) else None)


def weighted_sequences(
    tokenized: list[list[list[TokenizedSequence]]], advantages: list[list[float] | None]
) -> list[list[TokenizedSequence]]:
    """Per group, the sequences to train with their trajectory's advantage and weight: trajectories of
    skipped groups, with a zero advantage, or without sampled tokens (context only) are left out."""
    out: list[list[TokenizedSequence]] = []
    for per_trajectory, group_advantages_ in zip(tokenized, advantages, strict=True):
        kept: list[TokenizedSequence] = []
        for sequences, advantage in zip(per_trajectory, group_advantages_ or [], strict=False):
            trained = [s for s in sequences if s.num_sampled > 0]
            if advantage == 0.0 or not trained:
                continue
            weight = trajectory_weight(sum(s.num_sampled for s in trained))
            for s in trained:
                s.advantage, s.weight = advantage, weight
            kept += trained
        out.append(kept)
    return out
