"""The trainer's batched tensor helpers: snapshot copies and the finite check of the updated weights."""

from __future__ import annotations

import pytest
import torch

from art_sglang.training.train_state import all_finite, clones


def _tensors() -> list[torch.Tensor]:
    return [
        torch.randn(3, 4, requires_grad=True),
        torch.zeros(5, dtype=torch.bfloat16),
        torch.tensor([-0.0, 1.5]),
        torch.tensor(7),
    ]


def test_clones_are_equal_independent_detached_copies() -> None:
    tensors = _tensors()
    copies = clones(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and torch.equal(copy, tensor.detach())
        assert copy.data_ptr() != tensor.data_ptr() and not copy.requires_grad
    assert torch.signbit(copies[2][0])  # bit for bit: -0.0 stays -0.0
    with torch.no_grad():
        tensors[0].add_(1.0)
    tensors[1][0] = 3.0
    assert not torch.equal(copies[0], tensors[0].detach()) and copies[1][0] == 0.0


@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_element_anywhere_is_found(where: int, value: float) -> None:
    tensors = _tensors()
    assert all_finite(tensors)
    with torch.no_grad():
        tensors[where].view(-1)[-1] = value
    assert not all_finite(tensors)
