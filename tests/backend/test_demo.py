"""The demo (scripts/demo.py, README's main job) on the tiny model: the mean reward of the
character-share task rises over 12 steps with fixed seeds, and the run leaves its per-step results and a
reward-curve PNG next to its history.jsonl."""

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


def test_demo_reward_rises(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--path", str(tmp_path / ".art"),
         "--tiny-model-dir", str(tiny_model_path), "--steps", "12", "--json", str(out)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    steps = [row["step"] for row in rows]
    # Once every answer earns the same reward there is no signal and the step is not taken.
    assert len(rows) == 12 and steps[0] == 0 and steps == sorted(steps) and steps[-1] >= 9
    rewards = [row["mean_reward"] for row in rows]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.1, rewards
    assert "mean reward" in done.stdout and "train+sync" in done.stdout

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
