"""`SGLangBackend`: ART's backend protocol with inference on an SGLang server (or, without a GPU, the
reference engine) and a LoRA trainer in its own process.

The backend orchestrates; the parts live in their own modules: `devices` (split/shared/cpu layout),
`inference` (server + gateway + loaded adapters), `shared_mode` (GPU handoff around training),
`weight_sync` (lora/disk/restart), `model_store` (files on disk), `history` and `training` (the
trainer worker and `TrainOptions`, ART's train() keywords).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from .config import DeviceConfig, SGLangConfig, SharedStrategy, TrainerConfig
from .devices import DeviceLayout, EngineChoice, choose_layout, detect_gpus
from .errors import ConfigError, ModelNotRegisteredError, TrainingInputError
from .gpu_budget import SharedPlan, model_weights_bytes, plan_shared_gpu
from .history import append_row
from .inference import InferenceService
from .internal_config import ModelSettings, internal_config_of, model_settings
from .model import Model
from .model_store import ModelStore, base_model_problem, name_problem
from .run_lock import RunLock
from .shared_mode import GpuHandoff, HandoffStrategy
from .training.options import TrainOptions
from .training.process import TrainerProcess
from .training.sft import SFTBatch, sft_batches, validate_sft
from .training.validation import groups_to_wire, validate_groups
from .trajectories import Trajectory, TrajectoryGroup
from .types import LocalTrainResult
from .weight_sync import SyncTarget, make_weight_sync

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
WATCHDOG_MAX_PAUSE_S = 60.0


@dataclass
class _Registered:
    """A trainable model this backend serves: its files, its trainer and its current step."""

    model: Any  # art_sglang.TrainableModel or art.TrainableModel
    store: ModelStore
    trainer: TrainerProcess
    step: int
    lock: RunLock  # the model directory's, held while the model is registered

    def target(self, step: int) -> SyncTarget:
        checkpoint = self.store.checkpoint_dir(step)
        return SyncTarget(self.model.name, step, checkpoint, self.store, self.model.base_model)


class SGLangBackend:
    """Train LoRA adapters with RL while an SGLang server serves them.

    Mode (from the visible GPUs unless set): split with 2+ GPUs (server on the first, trainer on the
    rest), shared with one (server and trainer take turns: `shared_strategy` "sleep" releases the
    server's memory, "restart" stops it), and the CPU reference engine with none. `engine` forces
    "sglang" or "reference". `gateway=False` points clients at the server directly (no refusal of
    unloaded model names). `layout` overrides the device choice entirely (tests use it to force shared
    mode on CPU).
    """

    def __init__(
        self,
        *,
        inference_device: int | None = None,
        training_devices: list[int] | None = None,
        device_config: DeviceConfig | None = None,
        sglang_config: SGLangConfig | None = None,
        trainer_config: TrainerConfig | None = None,
        engine: EngineChoice = "auto",
        shared_strategy: SharedStrategy = "sleep",
        path: str = ".art",
        gateway: bool = True,
        layout: DeviceLayout | None = None,
    ):
        if shared_strategy not in ("sleep", "restart"):
            raise ConfigError(f"shared_strategy={shared_strategy!r}: use 'sleep' or 'restart'")
        if engine not in ("auto", "sglang", "reference"):
            raise ConfigError(f"engine={engine!r}: use 'auto', 'sglang' or 'reference'")
        self.trainer_config = trainer_config or TrainerConfig()
        config = sglang_config or SGLangConfig()
        _check_compatible(config, self.trainer_config)
        self.shared_strategy = shared_strategy
        # What the first model's _internal_config may still change (server flags, GPUs): see register.
        self._requested_config = config
        self._device_request = (device_config, engine)
        self._devices_given = (
            layout is not None or inference_device is not None or training_devices is not None
        )
        self._initial_layout = layout or choose_layout(
            device_config,
            inference_device=inference_device,
            training_devices=training_devices,
            engine=engine,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        self._configure(self._initial_layout, config)
        self._chosen_config = config  # the server's settings before shared mode's memory plan
        self._path = path
        self._use_gateway = gateway
        self._service: InferenceService | None = None
        self._handoff: GpuHandoff | None = None
        self._models: dict[tuple[str, str], _Registered] = {}
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        logger.info(
            "SGLangBackend: %s; weight sync %r%s",
            self.layout.describe(),
            self.sglang_config.weight_sync_method,
            f", shared strategy {shared_strategy!r}" if self.layout.mode == "shared" else "",
        )

    def _configure(self, layout: DeviceLayout, config: SGLangConfig) -> None:
        """Set the device layout and the server config that follows from it (shared mode's memory saver)."""
        self.layout = layout
        self.handoff_strategy: HandoffStrategy = self.shared_strategy if layout.mode == "shared" else "none"
        self.sglang_config = _with_memory_saver(config) if self.handoff_strategy == "sleep" else config

    # --- ART's backend protocol ------------------------------------------------------------------------
    async def register(self, model: Any) -> None:
        """Write model.json; for a trainable model start the trainer (resuming its newest checkpoint) and
        the server, and load the current step's adapter as `<name>@<step>`. Registering again is a no-op.

        Everything is checked before anything is written or started: names, the base model, the model's
        `_internal_config`, and that no other live backend has the model's directory (`ConfigError`). A
        registration that fails leaves the backend as it was (the first model's failure stops the server
        it started, so another base model can follow)."""
        self._check_open()
        for field in ("name", "project"):
            problem = name_problem(getattr(model, field))
            if problem is not None:
                raise ConfigError(f"model {field} {problem}")
        store = ModelStore(self._path, model.project, model.name)
        if not model.trainable:
            model.base_path = self._path
            await asyncio.to_thread(_write_model_files, store, model)
            return
        async with self._lock:
            key = (model.project, model.name)
            existing = self._models.get(key)
            if existing is not None:
                if existing.model.base_model != model.base_model:
                    raise ConfigError(
                        f"model {model.name!r} is already registered on base model "
                        f"{existing.model.base_model!r}; use another name for {model.base_model!r}"
                    )
                existing.model = model
                model.base_path = self._path
                return
            settings = self._check_can_add(model, store)
            lock = RunLock(store.dir)
            lock.acquire()
            try:
                entry = await self._start_model(model, store, settings, lock)
            except BaseException:
                lock.release()
                if not self._models and self._service is not None:
                    await self._service.close()
                    self._service = self._handoff = None
                raise
            self._models[key] = entry
            logger.info("registered %s at step %d (%s)", model.name, entry.step, store.dir)
        self._ensure_watchdog()

    async def _start_model(
        self, model: Any, store: ModelStore, settings: ModelSettings, lock: RunLock
    ) -> _Registered:
        """Write the model's files, start its trainer (resuming its checkpoint) and serve its step."""
        model.base_path = self._path  # as ART's LocalBackend: model.log() writes where we do
        await asyncio.to_thread(_write_model_files, store, model, settings)
        service = await self._ensure_service(model.base_model, store)
        assert self._handoff is not None
        trainer = TrainerProcess(
            model.base_model,
            store.checkpoints_dir,
            settings.trainer,
            gpu_ids=self._gpu_ids("training"),
            log_path=store.trainer_log,
        )
        try:
            if self._handoff.trainer_keeps_weights:
                # Both fit side by side on their GPU(s): load them at the same time.
                step, _ = await _gather_all(trainer.start(), service.start())
            else:
                # The trainer loads onto the GPU and moves to host memory before the server claims it.
                async with self._handoff.trainer_turn(trainer):
                    step = await trainer.start()
                await service.start()
            entry = _Registered(model, store, trainer, step, lock)
            await self._serve_step(entry, step, may_restart=False)
        except BaseException:
            await trainer.stop()
            raise
        return entry

    async def _prepare_backend_for_training(self, model: Any, config: Any | None = None) -> tuple[str, str]:
        """(OpenAI base URL ending in /v1, API key) for the model's rollouts."""
        if config:
            raise ConfigError(
                "SGLangBackend does not take an OpenAI server config at register: "
                "set server options with SGLangBackend(sglang_config=SGLangConfig(...))"
            )
        self._entry(model)
        assert self._service is not None
        return self._service.openai_base_url, self._service.api_key

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        """`<name>@<step>` (the current step when `step` is None), in the form the client sends (see
        `InferenceService.client_name`)."""
        if not getattr(model, "trainable", False):
            return model.inference_model_name or model.name
        entry = self._models.get((model.project, model.name))
        if step is None:
            if entry is None:
                raise ModelNotRegisteredError(
                    f"model {model.name!r} is not registered with this backend: "
                    "call `await model.register(backend)` first"
                )
            step = entry.step
        name = f"{model.name}@{step}"
        return self._service.client_name(name) if self._service is not None else name

    async def _get_step(self, model: Any) -> int:
        entry = self._models.get((model.project, model.name))
        if entry is not None:
            return entry.step
        steps = ModelStore(self._path, model.project, model.name).checkpoint_steps()
        return steps[-1] if steps else 0

    async def get_step(self, model: Any) -> int:
        """The model's latest trained step."""
        return await self._get_step(model)

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        """Delete every checkpoint not in `steps_to_keep`, never the current step; adapters of deleted
        steps are unloaded first (after their requests in flight finish)."""
        entry = self._entry(model)
        async with self._lock:
            keep = {*steps_to_keep, entry.step}
            doomed = [s for s in entry.store.checkpoint_steps() if s not in keep]
            assert self._service is not None
            for step in doomed:
                await self._service.remove_adapter(f"{model.name}@{step}")
            await asyncio.to_thread(entry.store.delete_checkpoints, doomed)

    async def train(self, model: Any, trajectory_groups: Iterable[Any], **options: Any) -> LocalTrainResult:
        """One RL step on `trajectory_groups`; returns once `<name>@<new step>` answers requests.

        Keywords are ART 0.5.18 `LocalBackend.train`'s, with its defaults (loss_fn="cispo",
        learning_rate=5e-6, ...): see `TrainOptions` (docs/configuration.md lists them). Options and groups
        are checked before anything starts (`ConfigError`, `TrainingInputError`). In shared mode the server
        gives the GPU to the trainer for the step. The step number advances on every call, as in ART (a
        batch without learning signal gets a copy of the last checkpoint), and the new step is served. A
        step the trainer refuses (non-finite values, a checkpoint that cannot be written) raises
        `TrainingError`; the trainer and the served step stay where they were.
        """
        self._check_open()
        train_options = TrainOptions.from_keywords(options)
        groups = _as_groups(trajectory_groups)
        # Checked here, before the GPU handoff, so bad input never takes the server away.
        validate_groups(
            groups_to_wire(groups),
            allow_training_without_logprobs=train_options.allow_training_without_logprobs,
        )
        entry = self._entry(model)
        _check_row_length(train_options, entry.trainer.config)
        self._ensure_watchdog()
        async with self._lock:
            service, handoff = self._service, self._handoff
            assert service is not None and handoff is not None
            started = time.monotonic()
            await service.recover()
            verbose = train_options.verbose
            with _progress(
                model.name, entry.step + 1, disable=not verbose and not sys.stderr.isatty()
            ) as bar:
                async with handoff.trainer_turn(entry.trainer) as turn:
                    if not entry.trainer.is_alive():
                        logger.warning(
                            "trainer of %s is not running; restarting it from its checkpoint", model.name
                        )
                        await entry.trainer.start()
                    trained_at = time.monotonic()
                    outcome = await entry.trainer.train(groups, train_options, on_progress=bar)
                    turn.timings["time/train_s"] = time.monotonic() - trained_at
                    if outcome.step != entry.step:
                        # Work that needs no server overlaps the handoff (merging, for disk sync).
                        await self._sync.prepare(entry.target(outcome.step))
            timings = turn.timings
            if outcome.step != entry.step:
                # Also a step a restarted trainer resumed at without training now (it died after
                # writing that checkpoint): it becomes the current step only once it is served.
                timings.update(
                    await self._serve_step(entry, outcome.step, may_restart=not turn.restarted_server)
                )
            if outcome.reason:
                logger.warning("%s step %d: %s", model.name, outcome.step, outcome.reason)
            dropped = int(outcome.metrics.get("sequences_dropped_too_long", 0))
            if dropped:
                logger.warning(
                    "%s step %d: dropped %d sequences longer than the packed row length (max_seq_length=%d)",
                    model.name, outcome.step, dropped, entry.trainer.config.max_seq_length,
                )  # fmt: skip
            timings["time/step_s"] = time.monotonic() - started
            metrics = {**outcome.metrics, **timings}
            row = {key if "/" in key else f"train/{key}": value for key, value in metrics.items()}
            written = await asyncio.to_thread(append_row, entry.store.history, entry.step, row)
            if isinstance(model, Model):  # ART's own models report to W&B themselves, from model.log
                await model._report(entry.step, written)
            if verbose:
                logger.info("%s step %d: %s", model.name, entry.step, json.dumps(metrics, default=str))
            path = outcome.checkpoint_path if train_options.save_checkpoint else None
            return LocalTrainResult(
                step=entry.step, metrics=metrics, checkpoint_path=str(path) if path else None
            )

    async def _train_sft(
        self,
        model: Any,
        trajectories: Iterable[Any],
        config: Any,
        dev_config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """Supervised fine-tuning (ART's backend protocol): yields each batch's metrics as the trainer
        reports them, and ends once `<name>@<new step>` answers requests. `config` is ART's or our
        `TrainSFTConfig`; ART's experimental `_config` has no options, so any key is refused.

        Input is checked before anything starts; the training (handoff, trainer, weight sync) runs as one
        task, so a caller that stops iterating early does not leave the step half done."""
        self._check_open()
        if dev_config:
            raise ConfigError(
                f"train_sft(_config={dict(dev_config)!r}): ART's dev TrainSFTConfig has no options"
            )
        wire = [_as_trajectory(t, index).model_dump(mode="python") for index, t in enumerate(trajectories)]
        validate_sft(wire)
        batches = sft_batches(wire, config.learning_rate, config.batch_size)
        entry = self._entry(model)
        self._ensure_watchdog()
        reports: asyncio.Queue[dict[str, float]] = asyncio.Queue()
        run = asyncio.ensure_future(self._run_sft(entry, batches, reports.put_nowait, verbose))
        while not (run.done() and reports.empty()):
            report = asyncio.ensure_future(reports.get())
            await asyncio.wait({report, run}, return_when=asyncio.FIRST_COMPLETED)
            if report.done():
                yield report.result()
            else:
                report.cancel()
        run.result()  # the training's error, if any

    async def _run_sft(self, entry: _Registered, batches: list[SFTBatch], report: Any, verbose: bool) -> None:
        async with self._lock:
            service, handoff = self._service, self._handoff
            assert service is not None and handoff is not None
            await service.recover()
            async with handoff.trainer_turn(entry.trainer) as turn:
                if not entry.trainer.is_alive():
                    logger.warning(
                        "trainer of %s is not running; restarting it from its checkpoint", entry.model.name
                    )
                    await entry.trainer.start()
                outcome = await entry.trainer.sft(
                    batches, on_progress=lambda event: report(event.get("metrics") or {})
                )
                await self._sync.prepare(entry.target(outcome.step))
            timings = turn.timings
            timings.update(await self._serve_step(entry, outcome.step, may_restart=not turn.restarted_server))
            if verbose:
                logger.info("%s SFT step %d: %s", entry.model.name, entry.step, json.dumps(timings))

    async def _log(self, model: Any, trajectory_groups: list[Any], split: str = "val") -> None:
        """Store the groups that `model.log()` recorded under `trajectories/<split>/<step>.jsonl`."""
        store = ModelStore(self._path, model.project, model.name)
        step = await self._get_step(model)
        lines = [group.model_dump_json() for group in _as_groups(trajectory_groups)]
        await asyncio.to_thread(_append_lines, store.trajectories_file(split, step), lines)

    async def close(self) -> None:
        """Stop the server, the gateway and every trainer. Idempotent; also done at interpreter exit by
        the process handles themselves."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._watchdog
        stops = [entry.trainer.stop() for entry in self._models.values()]
        if self._service is not None:
            stops.append(self._service.close())
        try:
            await _gather_all(*stops)
        finally:
            for entry in self._models.values():
                entry.lock.release()

    async def __aenter__(self) -> SGLangBackend:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # --- crash recovery --------------------------------------------------------------------------------
    def _ensure_watchdog(self) -> None:
        """Run the watchdog in the current event loop (again, if an earlier loop ended)."""
        if self._service is None or (self._watchdog is not None and not self._watchdog.done()):
            return
        self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="art-sglang-watchdog")

    async def _watch(self) -> None:
        """Restart a server that died, at any time (during train() too), with every adapter loaded again
        before it serves: new requests wait in the gateway meanwhile. Failed restarts are retried with a
        growing pause and raised to the user by the next train() or register()."""
        service = self._service
        assert service is not None
        pause = WATCHDOG_INTERVAL_S
        while not self._closed:
            await asyncio.sleep(pause)
            try:
                await service.recover()
                pause = WATCHDOG_INTERVAL_S
            except Exception:
                logger.exception("restarting the inference server failed")
                pause = min(pause * 2, WATCHDOG_MAX_PAUSE_S)

    async def _serve_step(self, entry: _Registered, step: int, *, may_restart: bool) -> dict[str, float]:
        """Make `<name>@<step>` servable and answering, then make it the model's current step. The one place
        the current step changes, so a name the backend hands out is always loaded. Returns timings."""
        service = self._service
        assert service is not None
        target = entry.target(step)
        synced_at = time.monotonic()
        await self._sync.prepare(target)
        await service.recover()
        await self._sync.apply(target, may_restart=may_restart)
        if self.sglang_config.flush_cache_on_sync:
            await service.flush_cache()
        probed_at = time.monotonic()
        await service.probe(target.inference_name)
        entry.step = step
        return {"time/sync_s": probed_at - synced_at, "time/probe_s": time.monotonic() - probed_at}

    # --- helpers ---------------------------------------------------------------------------------------
    @property
    def inference(self) -> InferenceService | None:
        """The inference service (server, gateway, loaded adapters), once a model is registered."""
        return self._service

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this SGLangBackend is closed: create a new one")

    def _entry(self, model: Any) -> _Registered:
        entry = self._models.get((model.project, model.name))
        if entry is None:
            raise ModelNotRegisteredError(
                f"model {model.name!r} is not registered with this backend: "
                "call `await model.register(backend)` first"
            )
        return entry

    def _check_can_add(self, model: Any, store: ModelStore) -> ModelSettings:
        """The model's settings, once it is certain this backend can serve and train it."""
        problem = base_model_problem(model.base_model)
        if problem is not None:
            raise ConfigError(f"model {model.name!r}: {problem}")
        for project, name in self._models:
            if name == model.name and project != model.project:
                # Adapters are served as <name>@<step>: two projects' models of one name would share them.
                raise ConfigError(
                    f"a model named {model.name!r} (project {project!r}) is already registered on this "
                    f"backend, and served adapter names are <name>@<step>: give the model of project "
                    f"{model.project!r} another name, or use a second SGLangBackend"
                )
        settings = model_settings(internal_config_of(model), self.trainer_config)
        if self._service is None:
            self._apply_first_model_settings(settings, store)
        else:
            self._check_same_server(model, settings)
        _check_compatible(self.sglang_config, settings.trainer)
        return settings

    def _apply_first_model_settings(self, settings: ModelSettings, store: ModelStore) -> None:
        """The first model's `_internal_config` may choose the server's flags and the GPUs."""
        config = self._requested_config.model_copy(update=_server_updates(settings, store))
        # Validated again with only the fields set, so settings the user left alone stay defaults.
        config = SGLangConfig.model_validate(config.model_dump(exclude_unset=True))
        layout = self._initial_layout
        if settings.inference_gpu_ids is not None and settings.trainer_gpu_ids is not None:
            layout = self._layout_for(settings.inference_gpu_ids, settings.trainer_gpu_ids, config)
        self._configure(layout, config)
        self._chosen_config = config

    def _layout_for(self, inference: list[int], training: list[int], config: SGLangConfig) -> DeviceLayout:
        if self._devices_given:
            raise ConfigError(
                "_internal_config sets trainer_gpu_ids/inference_gpu_ids, and SGLangBackend was given its "
                "devices too: set the GPUs in one place"
            )
        if len(inference) != config.tensor_parallel_size:
            raise ConfigError(
                f"_internal_config inference_gpu_ids={inference} must list tensor_parallel_size="
                f"{config.tensor_parallel_size} GPU(s) (consecutive, from the first)"
            )
        device_config, engine = self._device_request
        try:
            return choose_layout(
                device_config,
                inference_device=inference[0],
                training_devices=training,
                engine=engine,
                tensor_parallel_size=config.tensor_parallel_size,
            )
        except ConfigError as exc:
            raise ConfigError(f"_internal_config trainer_gpu_ids/inference_gpu_ids: {exc}") from None

    def _check_same_server(self, model: Any, settings: ModelSettings) -> None:
        """A later model shares the running server: it may not ask for different server settings."""
        assert self._service is not None
        if self._service.base_model != model.base_model:
            raise ConfigError(
                f"this backend serves base model {self._service.base_model!r}; model {model.name!r} uses "
                f"{model.base_model!r}: one server serves one base model, so use a second SGLangBackend"
            )
        if self.sglang_config.weight_sync_method == "disk":
            raise ConfigError(
                "weight_sync_method='disk' merges one model's weights into the server's base weights, so "
                "only one model can be registered: use weight_sync_method='lora' to serve several"
            )
        different: dict[str, Any] = {
            key: value
            for key, value in settings.server_updates.items()
            if getattr(self._chosen_config, key) != value
        }
        if settings.chat_template is not None:
            different["chat_template"] = "(the model's own template)"
        if settings.inference_gpu_ids is not None:
            different["inference_gpu_ids"] = settings.inference_gpu_ids
        if different:
            raise ConfigError(
                f"model {model.name!r} asks for server settings {different} in _internal_config, but this "
                "backend's server already runs for another model: one server serves every model of a "
                "backend, so use a second SGLangBackend"
            )

    async def _ensure_service(self, base_model: str, store: ModelStore) -> InferenceService:
        # The server's log lives with the first model registered (one server serves every model).
        if self._service is None:
            release: Literal["kv_cache", "all"] = "all"
            if self.handoff_strategy == "sleep":
                plan = await asyncio.to_thread(self._plan_shared_gpu, base_model)
                release = plan.release
                self.sglang_config = self.sglang_config.model_copy(
                    update={"mem_fraction_static": plan.mem_fraction_static}
                )
                logger.info(
                    "shared mode: each step releases the server's %s%s (mem_fraction_static %.3f): %s",
                    "KV cache; the trainer keeps its model on the GPU"
                    if plan.trainer_resident
                    else "weights",
                    "" if plan.trainer_resident else " and KV cache; the trainer moves to host memory",
                    plan.mem_fraction_static,
                    plan.reason,
                )
            self._service = InferenceService(
                self.sglang_config,
                base_model,
                engine=self.layout.engine,
                log_path=store.server_log,
                gpu_ids=self._gpu_ids("inference"),
                use_gateway=self._use_gateway,
            )
            if self.sglang_config.weight_sync_method != "disk":
                # Merged weights hold one step only; an older step's adapter on top would be wrong.
                self._service.serve_on_demand(self._checkpoint_of)
            self._handoff = GpuHandoff(self.handoff_strategy, self._service, release)
            self._sync = make_weight_sync(
                self.sglang_config.weight_sync_method, self._service, self.sglang_config.adapters_to_keep
            )
        return self._service

    def _plan_shared_gpu(self, base_model: str) -> SharedPlan:
        """What a sleep handoff releases, from the shared GPU's size and the base model's (blocking)."""
        config = self.sglang_config
        requested = config.sleep_release
        total: int | None = None
        if self.layout.engine == "sglang":
            gpus = {gpu.index: gpu for gpu in detect_gpus().gpus}
            gpu = gpus.get(self.layout.inference_gpus[0]) if self.layout.inference_gpus else None
            if gpu is None and requested == "auto":
                return SharedPlan("all", config.mem_fraction_static, "the GPU's memory size is unknown")
            total = gpu.memory_total_mib * 2**20 if gpu is not None else None
        return plan_shared_gpu(
            requested,
            gpu_total_bytes=total,
            weights_bytes=model_weights_bytes(base_model),
            mem_fraction_static=config.mem_fraction_static,
            fraction_set_by_user="mem_fraction_static" in config.model_fields_set,
        )

    def _checkpoint_of(self, name: str) -> Path | None:
        """The checkpoint folder of `<model>@<step>` if that step of a registered model is on disk."""
        model_name, _, step = name.rpartition("@")
        for entry in self._models.values():
            if (
                entry.model.name == model_name
                and step.isdigit()
                and int(step) in entry.store.checkpoint_steps()
            ):
                return entry.store.checkpoint_dir(int(step))
        return None

    def _gpu_ids(self, role: Literal["inference", "training"]) -> list[str]:
        """GPU ids (indices or UUIDs, as the user's CUDA_VISIBLE_DEVICES names them) for a child's
        CUDA_VISIBLE_DEVICES: none on CPU (hides every GPU)."""
        if self.layout.engine == "reference":
            return []
        return [part for part in self.layout.cuda_visible_devices(role).split(",") if part]


async def _gather_all(*calls: Awaitable[Any]) -> list[Any]:
    """Run `calls` concurrently and wait for every one of them, even when one fails (nothing is left
    running behind an error); then raise the first error."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _check_compatible(sglang: SGLangConfig, trainer: TrainerConfig) -> None:
    """Configuration clashes between server and trainer, found before anything starts."""
    if trainer.lora_rank > sglang.max_lora_rank:
        raise ConfigError(
            f"TrainerConfig(lora_rank={trainer.lora_rank}) exceeds SGLangConfig(max_lora_rank="
            f"{sglang.max_lora_rank}): the server could not load the adapters; raise max_lora_rank to "
            f"{trainer.lora_rank} or lower lora_rank"
        )
    served = set(sglang.lora_target_modules)
    if "all" not in served:
        fused = {"qkv_proj": {"q_proj", "k_proj", "v_proj"}, "gate_up_proj": {"gate_proj", "up_proj"}}
        for name, parts in fused.items():
            if name in served:
                served |= parts
        missing = sorted(set(trainer.target_modules) - served)
        if missing:
            raise ConfigError(
                f"TrainerConfig(target_modules) trains {missing}, which SGLangConfig(lora_target_modules="
                f"{sglang.lora_target_modules}) does not serve: add them, or use lora_target_modules=['all']"
            )


def _check_row_length(options: TrainOptions, trainer: TrainerConfig) -> None:
    if options.packed_sequence_length is not None and options.packed_sequence_length > trainer.max_seq_length:
        raise ConfigError(
            f"packed_sequence_length={options.packed_sequence_length} exceeds TrainerConfig(max_seq_length="
            f"{trainer.max_seq_length}): lower it, or raise max_seq_length"
        )


def _server_updates(settings: ModelSettings, store: ModelStore) -> dict[str, Any]:
    """SGLangConfig fields from a model's settings; a template given as text goes to a file the server
    reads (SGLang's --chat-template takes a path)."""
    updates = dict(settings.server_updates)
    if settings.chat_template_path is not None:
        updates["chat_template"] = settings.chat_template_path
    elif settings.chat_template is not None:
        updates["chat_template"] = str(store.chat_template_file)
    return updates


def _with_memory_saver(config: SGLangConfig) -> SGLangConfig:
    """Shared mode with "sleep" needs SGLang's memory saver and CPU weight backup: without them
    release_memory_occupation answers 200 and frees nothing."""
    if "enable_memory_saver" in config.model_fields_set and not config.enable_memory_saver:
        raise ConfigError(
            "shared_strategy='sleep' needs SGLangConfig(enable_memory_saver=True) (it was set to False): "
            "leave it unset, or use shared_strategy='restart'"
        )
    return config.model_copy(update={"enable_memory_saver": True, "enable_weights_cpu_backup": True})


def _as_groups(groups: Iterable[Any]) -> list[TrajectoryGroup]:
    """Our TrajectoryGroups; ART's (openpipe-art) are converted through their JSON form."""
    if groups is None or isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise TrainingInputError(
            f"train() takes a list of trajectory groups, got {type(groups).__name__}: pass what "
            "gather_trajectory_groups(...) returned"
        )
    result = []
    for index, group in enumerate(groups):
        if isinstance(group, TrajectoryGroup):
            result.append(group)
        elif hasattr(group, "model_dump") and hasattr(group, "trajectories"):
            result.append(TrajectoryGroup.model_validate(group.model_dump()))
        else:
            raise TrainingInputError(
                f"group {index} is a {type(group).__name__}, not a TrajectoryGroup: build groups with "
                "art.TrajectoryGroup(...) or gather_trajectory_groups(...)"
            )
    if not result:
        raise TrainingInputError("train() got no trajectory groups: gather at least one group")
    return result


def _as_trajectory(trajectory: Any, index: int) -> Trajectory:
    """Our Trajectory; ART's are converted through their JSON form."""
    if isinstance(trajectory, Trajectory):
        return trajectory
    if hasattr(trajectory, "model_dump") and hasattr(trajectory, "messages_and_choices"):
        return Trajectory.model_validate(trajectory.model_dump())
    raise TrainingInputError(
        f"SFT item {index} is a {type(trajectory).__name__}, not a Trajectory: build them with art.Trajectory(...)"
    )


def _model_json(model: Any) -> dict[str, Any]:
    # ART's model_dump includes its private config; whatever is not JSON becomes its repr.
    return json.loads(json.dumps(model.model_dump(), default=str))


def _write_model_files(store: ModelStore, model: Any, settings: ModelSettings | None = None) -> None:
    store.create()
    store.write_model_json(_model_json(model))
    if settings is not None and settings.chat_template is not None and settings.chat_template_path is None:
        store.chat_template_file.write_text(settings.chat_template, encoding="utf-8")


def _append_lines(path: Any, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write("".join(line + "\n" for line in lines))


# help(SGLangBackend.train) and editors that read __signature__ show every option with its default.
SGLangBackend.train.__signature__ = TrainOptions.signature(inspect.signature(SGLangBackend.train))  # type: ignore[attr-defined]


class _progress:
    """A tqdm bar over the step's gradient micro-batches, fed by the trainer's progress events."""

    def __init__(self, name: str, step: int, disable: bool):
        self.bar = tqdm(desc=f"train {name} step {step}", unit="batch", disable=disable, file=sys.stderr)

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("phase") == "train":
            self.bar.total = int(event.get("micro_batches", 0)) or None
            self.bar.n = int(event.get("micro_batch", 0))
            self.bar.refresh()

    def __enter__(self) -> _progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.bar.close()
