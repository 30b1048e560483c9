"""Where a training step's time goes: seconds per named phase, summed over one `train()` call, reported
as the step's `time/trainer_<phase>_s` metrics (the GPU benchmarks read them to tell, on 1, 2 and 3 ranks,
the work that data parallelism divides from the work every rank repeats).

On a GPU a phase ends with a device synchronisation, so its time is the device's work and not only the
launches; the step waits for the device at these points anyway (the loss value, the gradient norm, the
finite checks), so the timing changes nothing."""

from __future__ import annotations

import contextlib
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
