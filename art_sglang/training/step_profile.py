"""A timeline of one trainer step, for benchmarks (as SGLang's `SGLANG_TORCH_PROFILER_DIR` is for its
server): with `ART_SGLANG_TRAINER_PROFILE=DIR` (or `DIR:N`) each rank records its N-th `train` (default
the 3rd: after a warm-up step) with torch.profiler, CPU and CUDA, and writes into DIR
`train<N>-rank<r>-of-<ranks>.json.gz` (a Chrome trace), `.txt` (the costliest operators on the GPU, then on
the CPU: launches and host waits) and `-busy.json`:
the step's wall time against the time the GPU spent in kernels, which tells a step the GPU paces from one
its launches pace."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ENVIRONMENT = "ART_SGLANG_TRAINER_PROFILE"


class StepProfiler:
    """Counts `train` calls and profiles the one the environment names (none without the variable)."""

    def __init__(self, rank: int, ranks: int) -> None:
        folder, _, nth = os.environ.get(ENVIRONMENT, "").partition(":")
        self._folder = Path(folder) if folder else None
        self._nth = int(nth or 3)
        self._name = f"rank{rank}-of-{ranks}"
        self._calls = 0

    @contextlib.contextmanager
    def train_call(self) -> Iterator[None]:
        self._calls += 1
        if self._folder is None or self._calls != self._nth:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        started = time.perf_counter()
        with profile(activities=activities) as recorded:
            yield
        wall = time.perf_counter() - started
        self._folder.mkdir(parents=True, exist_ok=True)
        stem = self._folder / f"train{self._nth}-{self._name}"
        recorded.export_chrome_trace(f"{stem}.json.gz")
        averages = recorded.key_averages()
        sorts = ["self_device_time_total"] if cuda else []
        tables = [averages.table(sort_by=sort, row_limit=40) for sort in [*sorts, "self_cpu_time_total"]]
        Path(f"{stem}.txt").write_text("\n\n".join(tables))
        kernels_us = sum(event.self_device_time_total for event in averages) if cuda else 0.0
        busy = {
            "wall_s": wall,
            "gpu_kernels_s": kernels_us / 1e6,
            "gpu_busy_fraction": kernels_us / 1e6 / wall,
        }
        Path(f"{stem}-busy.json").write_text(json.dumps(busy, indent=1))
