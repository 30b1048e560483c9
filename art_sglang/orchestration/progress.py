"""A training step's progress: the bar in the user's terminal, and the reports a step makes while it runs."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from ..model import Model
from ..storage.history import append_row
from ..training.options import StepOutcome
from .registered_model import RegisteredModel

logger = logging.getLogger(__name__)

Report = TypeVar("Report")


class StepProgress:
    """A tqdm bar over the step's gradient micro-batches, fed by the trainer's progress events. `step`
    is the model's step before training: the bar reads "step N -> N+1", N as in "rollouts step N"."""

    def __init__(self, name: str, step: int, disable: bool):
        desc = f"train {name} step {step} -> {step + 1}"
        self.bar = tqdm(desc=desc, unit="batch", disable=disable, file=sys.stderr)

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("phase") == "train":
            self.bar.total = int(event.get("micro_batches", 0)) or None
            self.bar.n = int(event.get("micro_batch", 0))
            self.bar.refresh()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *_: object) -> None:
        self.bar.close()


async def reports_while(
    run: Callable[[Callable[[Report], None]], Awaitable[None]],
) -> AsyncIterator[Report]:
    """Start `run(report)` as one task and yield what it reports, as it reports it, until it ends; then
    raise its error, if any. A caller that stops iterating early does not stop the task."""
    reports: asyncio.Queue[Report] = asyncio.Queue()
    task = asyncio.ensure_future(run(reports.put_nowait))
    while not (task.done() and reports.empty()):
        report = asyncio.ensure_future(reports.get())
        await asyncio.wait({report, task}, return_when=asyncio.FIRST_COMPLETED)
        if report.done():
            yield report.result()
        else:
            report.cancel()
    task.result()  # the training's error, if any


def warn_about(entry: RegisteredModel, outcome: StepOutcome) -> None:
    """Log what a finished RL step of `entry` left out: the "no learning signal" warning once per run of
    such steps (history.jsonl records each one, gradient_steps 0), and sequences dropped as too long."""
    name, max_seq_length = entry.model.name, entry.trainer.config.max_seq_length
    if outcome.reason and outcome.reason != entry.untrained_reason:
        logger.warning(
            "%s step %d: %s; the step still advances (a copy of the last checkpoint), and further "
            "steps like it are not warned about until one trains",
            name, outcome.step, outcome.reason,
        )  # fmt: skip
    entry.untrained_reason = outcome.reason
    dropped = int(outcome.metrics.get("sequences_dropped_too_long", 0))
    if dropped:
        logger.warning(
            "%s step %d: dropped %d sequences longer than the packed row length (max_seq_length=%d)",
            name, outcome.step, dropped, max_seq_length,
        )  # fmt: skip


async def record_step(model: Any, history: Path, step: int, metrics: dict[str, float]) -> None:
    """Append a step's metrics to the model's history.jsonl and, for our own models, mirror the row to
    W&B (ART's own models report to W&B themselves, from model.log)."""
    row = {key if "/" in key else f"train/{key}": value for key, value in metrics.items()}
    written = await asyncio.to_thread(append_row, history, step, row)
    if isinstance(model, Model):
        await model._report(step, written)
