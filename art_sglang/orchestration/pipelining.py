"""Pipelined training (ART's `PipelineTrainer`): rollouts keep running on older steps while `train()` runs.

A rollout worker takes an adapter lease on the step it starts with (`SGLangBackend.adapter_lease`); inside
the lease, `model.get_inference_name()` names that step (the pin below, per task, as ART's LocalBackend
pins it) and the server keeps its adapter loaded until the lease ends. This module holds the pin; which
backends can pipeline at all is `planning.config_checks.pipelining_problem`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

_pinned_steps: ContextVar[dict[str, int] | None] = ContextVar("art_sglang_pinned_steps", default=None)


def pinned_step(model_name: str) -> int | None:
    """The step a lease pinned for `model_name` in this task, or None outside a lease."""
    return (_pinned_steps.get() or {}).get(model_name)


@asynccontextmanager
async def pin_step(model_name: str, step: int) -> AsyncIterator[None]:
    """`model.get_inference_name()` names `step` inside the block (this task and the ones it starts)."""
    token = _pinned_steps.set({**(_pinned_steps.get() or {}), model_name: step})
    try:
        yield
    finally:
        _pinned_steps.reset(token)
