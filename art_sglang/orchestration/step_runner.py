"""`StepRunner`: how a registered model's trainer and the inference servers take turns, and how a trained
step becomes the served one — one runner for RL and SFT steps, assembled from the serving plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from ..planning.serving_plan import ServingPlan
from ..process_tree import gather_all
from ..server.inference import InferenceService
from ..training.options import StepOutcome
from ..training.process import TrainerProcess
from .registered_model import RegisteredModel
from .shared_mode import GpuHandoff
from .weight_sync import WeightSync, make_weight_sync

logger = logging.getLogger(__name__)


class StepRunner:
    """Steps on `service`'s servers, with `handoff` giving the GPU to the trainer and `sync` publishing
    each new step. Callers run one step at a time."""

    def __init__(
        self, service: InferenceService, handoff: GpuHandoff, sync: WeightSync, *, flush_cache_on_sync: bool
    ) -> None:
        self._service = service
        self._handoff = handoff
        self._sync = sync
        self._flush_cache_on_sync = flush_cache_on_sync

    @classmethod
    def for_plan(cls, plan: ServingPlan, service: InferenceService) -> StepRunner:
        """The runner `plan` asks for: its handoff and its weight-sync method."""
        sync = make_weight_sync(plan.weight_sync, service, plan.server_config.adapters_to_keep)
        handoff = GpuHandoff(plan.handoff, service, plan.release)
        return cls(service, handoff, sync, flush_cache_on_sync=plan.server_config.flush_cache_on_sync)

    async def start(self, trainer: TrainerProcess) -> int:
        """Start a model's trainer (resuming its checkpoint) and the servers; returns the trainer's step."""
        if self._handoff.trainer_keeps_weights:
            # Both fit side by side on their GPU(s): load them at the same time.
            step, _ = await gather_all(trainer.start(), self._service.servers.start())
            return step
        # The trainer loads onto the GPU and moves to host memory before the server claims it.
        async with self._handoff.trainer_turn(trainer):
            step = await trainer.start()
        await self._service.servers.start()
        return step

    async def serve(self, entry: RegisteredModel, step: int) -> None:
        """Serve `step` of a model just registered (its trainer resumed there)."""
        await self._sync.prepare(entry.target(step))
        await self._publish(entry, step, may_restart=False)

    async def run(
        self, entry: RegisteredModel, train: Callable[[TrainerProcess], Awaitable[StepOutcome]]
    ) -> tuple[StepOutcome, dict[str, float]]:
        """One training step, RL or SFT: the GPU handed to the model's trainer (restarted from its
        checkpoint if it is not running) for `train`, then the new step published. Returns the outcome
        and the step's timings."""
        async with self._handoff.trainer_turn(entry.trainer) as turn:
            if not entry.trainer.is_alive():
                logger.warning(
                    "trainer of %s is not running; restarting it from its checkpoint", entry.model.name
                )
                await entry.trainer.start()
            trained_at = time.monotonic()
            outcome = await train(entry.trainer)
            turn.timings["time/train_s"] = time.monotonic() - trained_at
            if outcome.step != entry.step:
                # Work that needs no server overlaps the handoff (merging, for disk sync).
                await self._sync.prepare(entry.target(outcome.step))
        timings = turn.timings
        if outcome.step != entry.step:
            # Also a step a restarted trainer resumed at without training now (it died after writing that
            # checkpoint): it becomes the current step only once it is served.
            timings.update(await self._publish(entry, outcome.step, may_restart=not turn.restarted_server))
        return outcome, timings

    async def _publish(self, entry: RegisteredModel, step: int, *, may_restart: bool) -> dict[str, float]:
        """Make `<name>@<step>` (prepared) servable and answering, then make it the model's current step: the
        one place the current step changes, so a name the backend hands out is always loaded. A server that
        died meanwhile is restarted first. Returns timings."""
        target = entry.target(step)
        synced_at = time.monotonic()
        await self._service.servers.recover(probe=False)
        await self._sync.apply(target, may_restart=may_restart)
        if self._flush_cache_on_sync:
            await self._service.servers.flush_cache()
        probed_at = time.monotonic()
        await self._service.probe(target.inference_name)
        entry.step = step
        return {"time/sync_s": probed_at - synced_at, "time/probe_s": time.monotonic() - probed_at}
