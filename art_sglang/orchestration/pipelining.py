"""Pipelined training (ART's `PipelineTrainer`): rollouts keep running on older steps while `train()` runs.

A rollout worker takes an adapter lease on the step it starts with (`SGLangBackend.adapter_lease`); inside
the lease, `model.get_inference_name()` names that step (the pin below, per task, as ART's LocalBackend
pins it) and the server keeps its adapter loaded until the lease ends. This module holds the pin and the
rule of which backends can pipeline at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

from ..config import WeightSyncMethod
from ..planning.serving_plan import SYNC_TRAITS, HandoffStrategy

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


def pipelining_problem(
    handoff: HandoffStrategy, *, gateway: bool, weight_sync: WeightSyncMethod
) -> str | None:
    """Why a backend set up this way cannot train while rollouts run on older steps, with the fix; None
    when it can."""
    if handoff != "none":
        return (
            f"in shared mode with shared_strategy={handoff!r} the server hands the GPU to the trainer for each "
            "step, so rollouts stop while it trains: use shared_strategy='co_resident' when the server and the "
            "trainer both fit on the GPU, or a second GPU (split mode), or a synchronous loop"
        )
    if not gateway:
        return (
            "with gateway=False nothing checks that a rollout's adapter is still loaded (SGLang answers an "
            "unloaded name from the base model): use gateway=True (the default)"
        )
    if not SYNC_TRAITS[weight_sync].keeps_older_steps:
        return (
            f"weight_sync_method={weight_sync!r} serves only the newest step (older steps' rollouts would "
            "change policy or be cut off mid-request): use weight_sync_method='lora' (the default)"
        )
    return None
