"""The demo (scripts/demo.py, README's main job) on the tiny model: on a short run with fixed seeds the mean
reward of the character-share task rises while the rollouts stay diverse (no collapse onto one answer), and
the run leaves its per-step results and a reward-curve PNG next to its history.jsonl."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from backend_helpers import REPO

from art_sglang.storage.history import read_rows

STEPS = 14  # of the demo's default run: the part where the climb starts (the first steps stay near 0.33)


def test_demo_reward_rises(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--path", str(tmp_path / ".art"),
         "--tiny-model-dir", str(tiny_model_path), "--steps", str(STEPS), "--json", str(out)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    steps = [row["step"] for row in rows]
    assert steps == list(range(len(rows))) and 6 <= len(rows) <= STEPS
    if len(rows) < STEPS:  # it stops early only once every rollout scores the ceiling
        assert rows[-1]["min_reward"] == 1.0
    rewards = [row["mean_reward"] for row in rows]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.05, rewards
    # Rising by exploring: below the ceiling every step's rollouts still differ, so every step trained.
    assert all(row["max_reward"] > row["min_reward"] for row in rows if row["min_reward"] < 1.0), rows
    assert "mean reward" in done.stdout and "train+sync" in done.stdout
    assert "no optimizer step" not in done.stdout + done.stderr

    run_dir = tmp_path / ".art" / "demo" / "models" / "char-share"
    assert f"reward curve: {run_dir / 'reward_curve.png'}" in done.stdout
    assert json.loads((run_dir / "rewards.json").read_text()) == rows
    logged = [
        row for row in read_rows(run_dir / "history.jsonl") if "train/exception_rate" in row
    ]  # model.log
    assert [row["step"] for row in logged] == steps
    assert [row["train/reward"] for row in logged] == pytest.approx(rewards)
    image = matplotlib.image.imread(run_dir / "reward_curve.png")  # fails on anything but a valid PNG
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    assert (image[..., :3] < 0.5).any()  # something is drawn on the white canvas
