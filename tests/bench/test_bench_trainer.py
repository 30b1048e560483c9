"""scripts/bench_trainer.py on CPU (the peft path, one rank): a run starts a fresh trainer in its work
folder instead of resuming (or refusing) what an earlier run, of another model, left there, the idle
gap before each timed step is recorded, and each timed step's time and phases are kept beside the means."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from art_sglang.tiny_model import build_tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_trainer.py"


def _bench(model: Path, work: Path, out: Path, steps: int = 1) -> dict:
    arguments = ["--model", str(model), "--work", str(work), "--out", str(out), "--steps", str(steps)]
    arguments += ["--batch", "2", "--seq", "48", "--gap-s", "0.2"]
    subprocess.run([sys.executable, str(SCRIPT), *arguments], check=True, capture_output=True, timeout=300)
    return json.loads((out / "bench_trainer.json").read_text())


def test_a_run_clears_what_an_earlier_run_left_in_its_work_folder(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    work = tmp_path / "work"
    # An earlier run's trainer folder: a checkpoint of another model would be resumed, or refused.
    left = work / "peft-1-ranks" / "checkpoints" / "0001"
    left.mkdir(parents=True)
    (left / "adapter_config.json").write_text("{}")
    marker = left / "left-by-an-earlier-run"
    marker.write_text("")
    report = _bench(model, work, tmp_path / "out")
    (result,) = report["results"]
    assert "error" not in result, result.get("error")
    assert not list(work.rglob(marker.name))  # gone, not set aside beside the new run's checkpoints
    assert result["step_s"] > 0 and report["gap_s"] == 0.2


def test_each_timed_step_is_reported_and_the_steady_time_leaves_the_first_out(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    report = _bench(model, tmp_path / "work", tmp_path / "out", steps=3)
    (result,) = report["results"]
    assert "error" not in result, result.get("error")
    walls, each = result["step_s_each"], result["phases_s_each"]
    assert len(walls) == len(each) == 3
    assert result["step_s"] == statistics.fmean(walls)  # the mean stays what it was
    assert result["steady_step_s"] == statistics.fmean(walls[1:])
    assert result["step_s_median"] == statistics.median(walls)
    for name, mean in result["phases_s"].items():
        assert abs(mean - statistics.fmean(step.get(name, 0.0) for step in each)) < 1e-9, name
    for wall, phases in zip(walls, each, strict=True):
        assert phases["tokenize"] > 0 and phases["outside_trainer"] > 0
        # A step's parts add up to its wall time (the ranks' spread is not part of it).
        parts = [v for k, v in phases.items() if not k.endswith(("_slowest_rank", "_fastest_rank"))]
        assert abs(sum(parts) - wall) < 1e-6
    # Forward tokens as the trainer counted them (a whole number), not a rate times another window.
    forwarded = result["tokens_per_step"]
    assert forwarded == int(forwarded)
    assert result["trained_tokens_per_step"] < forwarded <= result["padded_tokens_per_step"]
    parts = result["checkpoint_parts_s"]
    assert sorted(parts) == ["adapter", "copy", "other_files", "rename", "wait"]
    assert sum(parts.values()) <= result["phases_s"]["checkpoint"]
    table = (tmp_path / "out" / "bench_trainer.md").read_text()
    assert "step s after the first" in table and "| peft | default | 1 | 3 |" in table
