"""A trainable model as a backend holds it while it is registered: its files, its trainer, its current step
and the lock on its directory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..serving.served_names import parse_served_name
from ..storage.model_store import ModelStore
from ..storage.run_lock import RunLock
from ..training.process import TrainerProcess
from .weight_sync import SyncTarget


@dataclass
class RegisteredModel:
    """A trainable model this backend serves: its files, its trainer and its current step."""

    model: Any  # art_sglang.TrainableModel or art.TrainableModel
    store: ModelStore
    trainer: TrainerProcess
    step: int
    lock: RunLock  # the model directory's, held while the model is registered
    pipelined: bool = False  # rollouts took adapter leases (ART's PipelineTrainer drives the model)
    warned_pool: bool = False  # the "more steps in use than LoRA pool slots" warning was given
    untrained_reason: str | None = None  # why the last step took no optimizer step; None: it trained

    def target(self, step: int) -> SyncTarget:
        checkpoint = self.store.checkpoint_dir(step)
        return SyncTarget(self.model.name, step, checkpoint, self.store, self.model.base_model, self.trainer)


def checkpoint_of(models: Iterable[RegisteredModel], name: str) -> Path | None:
    """The checkpoint folder of `<model>@<step>` if that step of a registered model is on disk."""
    parsed = parse_served_name(name)
    if parsed is None:
        return None
    model_name, step = parsed
    for entry in models:
        if entry.model.name == model_name and step in entry.store.checkpoint_steps():
            return entry.store.checkpoint_dir(step)
    return None
