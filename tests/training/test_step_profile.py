"""The benchmarks' step profile: only the train call the environment names is recorded, into its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from art_sglang.training.step_profile import ENVIRONMENT, StepProfiler


def test_the_named_train_call_is_profiled_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENVIRONMENT, f"{tmp_path / 'profile'}:2")
    profiler = StepProfiler(rank=1, ranks=2)
    for _ in range(3):
        with profiler.train_call():
            torch.randn(64, 64) @ torch.randn(64, 64)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "train2-rank1-of-2-busy.json",
        "train2-rank1-of-2.json.gz",
        "train2-rank1-of-2.txt",
    ]
    assert "aten::mm" in (tmp_path / "profile/train2-rank1-of-2.txt").read_text()
    busy = json.loads((tmp_path / "profile/train2-rank1-of-2-busy.json").read_text())
    assert busy["wall_s"] > 0 and busy["gpu_kernels_s"] == 0.0  # no GPU here


def test_without_the_variable_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    monkeypatch.chdir(tmp_path)
    profiler = StepProfiler(rank=0, ranks=1)
    for _ in range(4):
        with profiler.train_call():
            pass
    assert list(tmp_path.iterdir()) == []
