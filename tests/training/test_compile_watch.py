"""`CompileWatch` counts what torch.compile compiles between two moments of a process: nothing for a shape
it has compiled, one graph for a batch of one after dynamic batches (torch specialises a size of 1, as
Unsloth's per-layer regions meet it in the middle of a run)."""

from __future__ import annotations

import torch

from art_sglang.training.phase_times import CompileWatch


def test_a_batch_of_one_compiles_again_after_dynamic_batches() -> None:
    double_sine = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    double_sine(torch.ones(3, 4))
    double_sine(torch.ones(5, 4))  # a second batch size: the batch dimension becomes dynamic
    watch = CompileWatch()
    double_sine(torch.ones(7, 4))
    assert watch.since() == (0, 0.0)
    double_sine(torch.ones(1, 4))
    graphs, seconds = watch.since()
    assert graphs == 1 and seconds > 0
