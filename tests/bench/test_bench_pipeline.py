"""scripts/bench_pipeline.py's rates: what a loop's step ends and trained trajectories come to (the loops
themselves run through the backend in tests/test_pipelining.py and on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_pipeline import loop_rates, ratio


def test_steady_rates_leave_out_the_first_step_and_count_trained_trajectories() -> None:
    # A 40 s first step (the trainer compiling), then 10 s steps; the last step trained 16 of 64.
    rates = loop_rates(0.0, [40.0, 50.0, 60.0, 70.0], [64, 64, 64, 16])
    assert rates["steps"] == 4 and rates["wall_s"] == 70.0
    assert rates["step_s"] == [40.0, 10.0, 10.0, 10.0]
    assert rates["steps_per_minute"] == pytest.approx(60 * 4 / 70)
    assert rates["steady_steps_per_minute"] == pytest.approx(6.0)
    assert rates["steady_trajectories_per_minute"] == pytest.approx(60 * 144 / 30)
    one_step = loop_rates(0.0, [40.0], [64])
    assert one_step["steady_steps_per_minute"] is None and one_step["steady_trajectories_per_minute"] is None


def test_a_short_last_step_does_not_count_as_a_full_one() -> None:
    sync = loop_rates(0.0, [40.0, 50.0, 60.0, 70.0], [64, 64, 64, 64])
    pipelined = loop_rates(0.0, [40.0, 49.0, 58.0, 61.0], [64, 64, 64, 16])
    loops = {"sync": sync, "pipelined": pipelined}
    # By steps, the short last step makes the pipelined loop look 1.43x faster; by work, it is 0.95x.
    assert ratio(loops, "steady_steps_per_minute") == pytest.approx(30 / 21)
    assert ratio(loops, "steady_trajectories_per_minute") == pytest.approx((144 / 21) / (192 / 30))
    one = loop_rates(0.0, [1.0], [8])
    assert ratio({"sync": one, "pipelined": one}, "steady_steps_per_minute") is None
