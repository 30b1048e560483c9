"""Where a training step's time goes: seconds per named phase, summed over one `train()` call, reported
as the step's `time/trainer_<phase>_s` metrics (the GPU benchmarks read them to tell, on 1, 2 and 3 ranks,
the work that data parallelism divides from the work every rank repeats); and what torch.compile did in
the call (`CompileWatch`: a step that meets a new shape compiles again, 20 s against 4 on an H200).

On a GPU a phase ends with a device synchronisation, so its time is the device's work and not only the
launches; the step waits for the device at these points anyway (the loss value, the gradient norm, the
finite checks), so the timing changes nothing."""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class PhaseTimes:
    """Seconds per phase of one call, on this rank."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize(self._device)
            self.seconds[name] += time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        return {f"time/trainer_{name}_s": seconds for name, seconds in self.seconds.items()}


class CompileWatch:
    """The graphs torch.compile compiled in this process since the watch began, and the seconds Dynamo
    spent compiling frames (Inductor's forward compile included). Unsloth compiles each decoder layer with
    dynamic sequence and batch dimensions, except a batch of one, which torch specialises: the first
    micro-batch of one sequence compiles anew in the middle of a run."""

    def __init__(self) -> None:
        self._graphs, self._seconds = _compile_totals()

    def since(self) -> tuple[int, float]:
        """(graphs compiled, seconds compiling) since the watch began."""
        graphs, seconds = _compile_totals()
        return graphs - self._graphs, seconds - self._seconds


def _compile_totals() -> tuple[int, float]:
    # Dynamo's own counters (private, kept since torch 2.1): per process, from its start.
    from torch._dynamo.utils import compilation_time_metrics, counters

    return counters["stats"]["unique_graphs"], math.fsum(
        compilation_time_metrics.get("_compile.compile_inner", ())
    )
