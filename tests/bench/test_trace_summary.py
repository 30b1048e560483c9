"""scripts/trace_summary.py: the GPU's busy time is the union of its kernels and copies, and a gap is
reported with the host operation that ran during it."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_summary.py"


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_gaps_and_the_host_during_a_gap(tmp_path: Path) -> None:
    events = [
        _event("kernel", "gemm", 0, 4000),
        _event("kernel", "softmax", 2000, 4000),  # overlaps gemm: busy 0..6 ms
        _event("gpu_memcpy", "Memcpy HtoD", 16000, 4000),  # after a 10 ms gap: busy 16..20 ms
        _event("cuda_runtime", "cudaStreamSynchronize", 6500, 9000),
        _event("cpu_op", "Optimizer.step#AdamW.step", 6200, 9500),
        _event("cpu_op", "aten::isfinite", 7000, 500),
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    trace = tmp_path / "step.json.gz"
    with gzip.open(trace, "wt") as stream:
        json.dump({"traceEvents": events}, stream)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace)], check=True, capture_output=True, text=True
    ).stdout
    assert "wall 0.020 s, GPU busy (union of kernels and copies) 0.010 s = 50.0%, 3 kernels and copies" in out
    assert "GPU idle 0.010 s in 1 gaps; over 1 ms: 0.010 s in 1" in out
    assert "cudaStreamSynchronize                       0.009       1" in out
    assert "   10.00 @   0.006  ['Optimizer.step#AdamW.step']" in out
