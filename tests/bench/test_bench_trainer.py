"""scripts/bench_trainer.py on CPU (the peft path, one rank): a run starts a fresh trainer in its work
folder instead of resuming (or refusing) what an earlier run, of another model, left there, and the idle
gap before each timed step is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from art_sglang.tiny_model import build_tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_trainer.py"


def _bench(model: Path, work: Path, out: Path) -> dict:
    arguments = ["--model", str(model), "--work", str(work), "--out", str(out), "--steps", "1"]
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
