"""scripts/bench_trainer.py on CPU (the peft path, one rank): a second run in the same work folder with
another model starts a fresh trainer instead of resuming (or refusing) the first model's checkpoints, and
the idle gap before each timed step is recorded."""

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


def test_a_second_model_in_the_same_work_folder_gets_a_fresh_trainer(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "first", hidden=64)
    second = build_tiny_model(tmp_path / "second", hidden=32)
    work = tmp_path / "work"
    _bench(first, work, tmp_path / "out1")
    report = _bench(second, work, tmp_path / "out2")
    (result,) = report["results"]
    assert "error" not in result, result.get("error")
    assert result["step_s"] > 0 and report["gap_s"] == 0.2
