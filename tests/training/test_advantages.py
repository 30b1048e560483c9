"""Group-relative advantages, checked against values computed by hand."""

from __future__ import annotations

import math

import pytest

from art_sglang.training.advantages import STD_EPS, group_advantages


def test_centred_without_scaling() -> None:
    adv = group_advantages([[1.0, 0.0, 0.5, 0.5]], scale_rewards=False)
    assert adv.per_group == [[0.5, -0.5, 0.0, 0.0]]
    assert adv.groups_skipped == 0 and adv.groups_trained == 1


def test_scaled_by_population_std() -> None:
    # rewards 3, 1: mean 2, population std 1 -> advantages +1/(1+eps), -1/(1+eps)
    adv = group_advantages([[3.0, 1.0]], scale_rewards=True).per_group[0]
    assert adv == pytest.approx([1 / (1 + STD_EPS), -1 / (1 + STD_EPS)], rel=1e-12)
    # rewards 0, 0, 3: mean 1, std sqrt((1 + 1 + 4) / 3) = sqrt(2)
    adv = group_advantages([[0.0, 0.0, 3.0]], scale_rewards=True).per_group[0]
    s = math.sqrt(2) + STD_EPS
    assert adv == pytest.approx([-1 / s, -1 / s, 2 / s], rel=1e-12)


def test_zero_variance_groups_are_skipped_and_counted() -> None:
    adv = group_advantages([[1.0, 1.0, 1.0], [0.0, 1.0], [0.25], [-2.0, -2.0]], scale_rewards=True)
    assert adv.per_group[0] is None and adv.per_group[2] is None and adv.per_group[3] is None
    assert adv.per_group[1] is not None
    assert adv.groups_skipped == 3 and adv.groups_trained == 1


def test_huge_rewards_give_finite_normalized_advantages() -> None:
    # ±1e39 overflows float32; the normalization runs in float64, so the trained advantages are ±1.
    from art_sglang.training.advantages import balance, batch_scale, trajectory_weight

    per_group = group_advantages([[1e39, -1e39]], scale_rewards=False).per_group[0]
    assert per_group == [1e39, -1e39]
    items = [(4, a, trajectory_weight(4)) for a in per_group]
    scale = batch_scale(items, advantage_balance=0.0)
    assert scale.advantage_scale is not None
    assert [balance(a, 0.0) * scale.advantage_scale for a in per_group] == pytest.approx([1.0, -1.0])
