"""The demo (scripts/demo.py, README's main job) on the tiny model: the mean reward of the
character-share task rises over 12 steps with fixed seeds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from backend_helpers import REPO


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
