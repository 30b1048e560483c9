"""`StepRunner`: how a registered model's trainer and the inference servers take turns, and how a trained
step becomes the served one — one runner for RL and SFT steps, assembled from the serving plan."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..errors import ServerRequestError, ServerUnavailableError, TrainerError, TrainingError
from ..planning.serving_plan import ServingPlan
from ..process_tree import gather_all
from ..serving.adapters import InferenceService
from ..storage.checkpoints import set_aside
from ..training.options import StepOutcome
from ..training.process import TrainerProcess
from .registered_model import RegisteredModel
from .shared_mode import GpuHandoff
from .weight_sync import SyncTarget, WeightSync, make_weight_sync

logger = logging.getLogger(__name__)

# A step's sync that meets a dead server (or one stuck in an adapter operation) is tried this often, a
# pause apart, each time after recovery restarted the server.
SYNC_ATTEMPTS = 4
SYNC_RETRY_PAUSE_S = 1.0


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
        self._prefill_counts: dict[str, int] = {}  # the gateway's prefill counters at the previous step

    @classmethod
    def for_plan(cls, plan: ServingPlan, service: InferenceService) -> StepRunner:
        """The runner `plan` asks for: its handoff and its weight-sync method."""
        config = plan.server_config
        sync = make_weight_sync(
            plan.weight_sync, service, config.adapters_to_keep, config.merged_bucket_bytes
        )
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
        self,
        entry: RegisteredModel,
        train: Callable[[TrainerProcess], Awaitable[StepOutcome]],
        *,
        learning_rate: float | None = None,
    ) -> tuple[StepOutcome, dict[str, float]]:
        """One training step, RL or SFT: the GPU handed to the model's trainer (restarted from its
        checkpoint if it is not running) for `train`, then the new step published. Returns the outcome
        and the step's timings. `learning_rate`: what the step trains with, named if its adapter does not
        serve and the step is refused (`TrainingError`)."""
        async with self._handoff.trainer_turn(entry.trainer) as turn:
            if not entry.trainer.is_alive():
                logger.warning(
                    "trainer of %s is not running; restarting it from its checkpoint", entry.model.name
                )
                await entry.trainer.start()
            trained_at = time.monotonic()
            try:
                outcome = await train(entry.trainer)
            except TrainerError as exc:
                told = _with_saved_step(exc, entry)
                if told is exc:
                    raise
                raise told from exc
            turn.timings["time/train_s"] = time.monotonic() - trained_at
            if outcome.step != entry.step:
                # Work that needs no server overlaps the handoff (merging, for disk sync).
                await self._sync.prepare(entry.target(outcome.step))
        timings = turn.timings
        if outcome.step != entry.step:
            # Also a step a restarted trainer resumed at without training now (it died after writing that
            # checkpoint): it becomes the current step only once it is served.
            timings.update(
                await self._publish(
                    entry, outcome.step, may_restart=not turn.restarted_server, learning_rate=learning_rate
                )
            )
        return outcome, timings

    def prefill_counts_since_last_step(self) -> dict[str, int]:
        """What the gateway's prefill sharing saved since the previous step, as `rollout/*` metrics
        (docs/guide.md)."""
        gateway = self._service.gateway
        if gateway is None:
            return {}
        now = gateway.prefill_counters()
        since = {f"rollout/{key}": value - self._prefill_counts.get(key, 0) for key, value in now.items()}
        self._prefill_counts = now
        return since

    async def _publish(
        self, entry: RegisteredModel, step: int, *, may_restart: bool, learning_rate: float | None = None
    ) -> dict[str, float]:
        """Make `<name>@<step>` (prepared) servable and answering, then make it the model's current step: the
        one place the current step changes, so a name the backend hands out is always loaded. A server that
        died meanwhile is restarted first. Returns timings.

        `learning_rate`: the step was just trained with it; if its adapter does not answer what rollouts
        ask (finite logprobs), the step is rolled back (`_refuse`) and `TrainingError` raised."""
        target = entry.target(step)
        synced_at = time.monotonic()
        try:
            await self._apply(target, may_restart=may_restart)
        except ServerRequestError as exc:
            if learning_rate is None:
                raise
            raise type(exc)(
                f"{exc}\nStep {step} of {entry.model.name} was trained and saved ({target.checkpoint}) but "
                f"could not be served: its update is kept, the next train() trains on from it and publishes "
                f"step {step + 1}; step {entry.step} stays served until then.",
                status=exc.status,
                server_message=exc.server_message,
            ) from exc
        if self._flush_cache_on_sync:
            await self._service.servers.flush_cache()
        probed_at = time.monotonic()
        try:
            await self._service.probe(target.inference_name)
        except ServerRequestError as exc:
            if learning_rate is None:
                raise
            await self._refuse(entry, step)
            raise TrainingError(
                f"step {step} of {entry.model.name} was refused before it was published: its adapter does "
                f"not serve ({exc}). It was trained with learning_rate={learning_rate:g}; a smaller one may "
                f"help. Step {entry.step} stays served and the next train() starts from it."
            ) from exc
        entry.step = step
        return {"time/sync_s": probed_at - synced_at, "time/probe_s": time.monotonic() - probed_at}

    async def _apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        """`sync.apply`, with a server that dies meanwhile (or is stuck in an adapter operation) waited out
        as at every other moment: recovery restarts it with every published step, then the sync is tried
        again; the last failure is raised."""
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            await self._service.servers.recover(probe=False)
            try:
                await self._sync.apply(target, may_restart=may_restart)
                return
            except ServerUnavailableError as exc:
                if attempt == SYNC_ATTEMPTS:
                    raise
                logger.warning(
                    "serving %s failed (%s); trying again once the server is back", target.inference_name, exc
                )
                await asyncio.sleep(SYNC_RETRY_PAUSE_S)

    async def _refuse(self, entry: RegisteredModel, step: int) -> None:
        """Undo a trained step that may not be published: set its checkpoint aside (one rename, so a crash
        never leaves it to be resumed), stop the trainer that holds its weights (the next step restarts it
        from the current step's checkpoint) and serve the current step again in its place."""
        aside = await asyncio.to_thread(set_aside, entry.store.checkpoint_dir(step))
        logger.warning("%s step %d refused; its checkpoint is kept as %s", entry.model.name, step, aside)
        await entry.trainer.stop()
        await self._service.remove_adapter(entry.target(step).inference_name)
        current = entry.target(entry.step)
        await self._sync.prepare(current)
        await self._sync.apply(current, may_restart=False)


def _with_saved_step(exc: TrainerError, entry: RegisteredModel) -> TrainerError:
    """`exc`, told about a step the trainer saved but never reported (it hung or died after the write)."""
    saved = max(entry.store.checkpoint_steps(), default=entry.step)
    if saved <= entry.step:
        return exc
    return type(exc)(
        f"{exc}\nStep {saved} was saved before that ({entry.store.checkpoint_dir(saved)}): its update is "
        f"kept, the next train() resumes from it and publishes step {saved + 1}; step {entry.step} stays "
        "served until then."
    )
