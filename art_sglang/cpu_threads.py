"""One intra-op thread for small models on CPU (the reference engine and the CPU trainer).

A small model runs one step in about a millisecond on one core; more intra-op threads only add
synchronisation, which costs 10x or more on a busy machine (measured on 2 shared cores: 20 SFT steps of
the tiny model took 1.2 s on one thread and 48 s on two). `OMP_NUM_THREADS`, when set, wins.
"""

from __future__ import annotations

import os
from typing import Any

SINGLE_THREAD_PARAMS = 50_000_000


def limit_threads_for_small_model(model: Any) -> None:
    import torch

    if "OMP_NUM_THREADS" not in os.environ and model.num_parameters() < SINGLE_THREAD_PARAMS:
        torch.set_num_threads(1)
