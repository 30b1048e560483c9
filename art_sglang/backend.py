"""`SGLangBackend`: ART's backend protocol with inference on an SGLang server (or, without a GPU, the
reference engine) and a LoRA trainer in its own process.

The backend orchestrates; its parts: `planning` (the request, and the frozen plan made from it and the
first model's `_internal_config`), `serving` (adapters, gateway, server replicas), `orchestration` (a
training step: GPU handoff, trainer, weight sync), `storage` (files on disk) and `training` (the trainer
worker and `TrainOptions`, ART's train() keywords).
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
from typing import Any

from .cluster import ray_cluster
from .config import ClusterConfig, CudaMpsMode, DeviceConfig, SGLangConfig, SharedStrategy, TrainerConfig
from .cuda_mps import CudaMps, control_program, start_daemon
from .errors import ConfigError, ModelNotRegisteredError
from .orchestration.off_policy import check_off_policy
from .orchestration.pipelining import pin_step, pinned_step
from .orchestration.progress import StepProgress, record_step, reports_while, warn_about
from .orchestration.registered_model import RegisteredModel, checkpoint_of
from .orchestration.step_runner import StepRunner
from .planning.config_checks import check_new_model, check_row_length, check_same_server, pipelining_problem
from .planning.devices import DeviceLayout, EngineChoice, detect_gpus, device_request
from .planning.gpu_budget import model_weights_bytes
from .planning.internal_config import ModelSettings, internal_config_of, model_settings
from .planning.make_plan import make_plan, settle
from .planning.request import BackendRequest
from .planning.serving_plan import SYNC_TRAITS, HandoffStrategy, ServingPlan
from .process_tree import gather_all
from .serving.adapters import InferenceService
from .serving.served_names import served_name, served_prefix, steps_of
from .serving.servers.watchdog import ServerWatchdog
from .storage.base_model_source import check_base_model_source
from .storage.model_store import ModelStore, append_lines, name_problem, write_model_files
from .storage.run_lock import RunLock
from .training.options import TrainOptions
from .training.process import TrainerProcess
from .training.sft import SFTBatch, prepare_sft
from .training.validation import check_groups
from .trajectories import coerce_groups, coerce_trajectory
from .types import LocalTrainResult

logger = logging.getLogger(__name__)


class SGLangBackend:
    """Train LoRA adapters with RL while an SGLang server serves them.

    Mode (from the visible GPUs unless set): split with 2+ GPUs (server on the first, trainer on the
    rest), shared with one (server and trainer take turns: `shared_strategy` "sleep" releases the
    server's memory, "restart" stops it; "co_resident" keeps both on the GPU with no handoff, for
    pipelined training, their kernels side by side under a CUDA MPS daemon of the backend's own where
    `cuda_mps` allows: "auto" where the driver's MPS program is found, "on" or "off"), and the CPU
    reference engine with none. `engine` forces "sglang" or "reference". GPUs are asked for in one form,
    `device_config`; `inference_device(s)`/`training_devices` are sugar for it (GPUs in both: ConfigError).
    `inference_devices=[0, 1]` starts one server replica per listed GPU (the gateway picks each request's
    replica, SGLang's router checks their health), every adapter loaded on each before its name is served.
    `cluster=ClusterConfig(...)` runs the replicas as Ray actors on a Ray cluster's nodes
    (docs/several-machines.md). `gateway=False` points clients at the server directly (no refusal of
    unloaded model names). `layout` is a finished device layout given alone (CPU tests force shared mode).
    """

    def __init__(
        self,
        *,
        inference_device: int | None = None,
        training_devices: list[int] | None = None,
        inference_devices: list[int] | None = None,
        device_config: DeviceConfig | None = None,
        sglang_config: SGLangConfig | None = None,
        trainer_config: TrainerConfig | None = None,
        engine: EngineChoice = "auto",
        shared_strategy: SharedStrategy = "sleep",
        path: str = ".art",
        gateway: bool = True,
        layout: DeviceLayout | None = None,
        cuda_mps: CudaMpsMode = "auto",
        cluster: ClusterConfig | str | None = None,
    ):
        self.trainer_config = trainer_config or TrainerConfig()
        self.shared_strategy = shared_strategy
        devices = device_request(
            device_config, "SGLangBackend's arguments", inference_device=inference_device,
            inference_devices=inference_devices, training_devices=training_devices,
        )  # fmt: skip
        self._request = BackendRequest(
            sglang_config or SGLangConfig(), self.trainer_config, devices, engine=engine, layout=layout,
            shared_strategy=shared_strategy, cuda_mps=cuda_mps, gateway=gateway,
            cluster=ClusterConfig(address=cluster) if isinstance(cluster, str) else cluster,
        )  # fmt: skip
        # The machine, looked at once; until the first model the backend shows what the request settles.
        self._gpus, self._mps_found = detect_gpus(), control_program() is not None
        self._settled = settle(self._request, None, self._gpus, mps_found=self._mps_found)
        self._path = path
        self._plan: ServingPlan | None = None  # made once, before the first server starts
        self._service: InferenceService | None = None
        self._mps: CudaMps | None = None
        self._steps: StepRunner | None = None
        self._models: dict[tuple[str, str], RegisteredModel] = {}
        self._lock = asyncio.Lock()
        self._watchdog: ServerWatchdog | None = None
        self._closed = False
        logger.info("SGLangBackend: %s", self._settled.describe())

    @property
    def layout(self) -> DeviceLayout:
        return (self._plan or self._settled).layout

    @property
    def sglang_config(self) -> SGLangConfig:
        """The server's settings: the plan's once a model is registered (frozen), else as asked so far."""
        return (self._plan or self._settled).server_config

    @property
    def handoff_strategy(self) -> HandoffStrategy:
        return (self._plan or self._settled).handoff

    @property
    def uses_cuda_mps(self) -> bool:
        """Whether the server and trainer run as clients of the backend's CUDA MPS daemon now."""
        return self._mps is not None and self._mps.is_alive()

    # --- ART's backend protocol ------------------------------------------------------------------------
    async def register(self, model: Any) -> None:
        """Write model.json; for a trainable model start the trainer (resuming its newest checkpoint) and
        the server, and load the current step's adapter as `<name>@<step>`. Registering again is a no-op.

        All is checked before anything is written or started (`ConfigError`): names, the base model and
        that its files can be had, `_internal_config`, that no other live backend has the model's directory.
        A failed registration leaves the backend as it was (the first model's stops the server it started)."""
        self._check_open()
        for field in ("name", "project"):
            if (problem := name_problem(getattr(model, field))) is not None:
                raise ConfigError(f"model {field} {problem}")
        store = ModelStore(self._path, model.project, model.name)
        if not model.trainable:
            model.base_path = self._path
            await asyncio.to_thread(write_model_files, store, model)
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
            check_new_model(model, list(self._models))
            settings = model_settings(internal_config_of(model), self._request.trainer)
            plan = self._plan
            if plan is None or self._service is None:  # the first model: the plan is made for it, once
                plan = await asyncio.to_thread(lambda: make_plan(
                    self._request, settings, self._gpus, template_file=str(store.chat_template_file),
                    weights_bytes=model_weights_bytes(model.base_model), mps_found=self._mps_found,
                ))  # fmt: skip
            else:
                check_same_server(model, settings, plan, self._service.base_model)
            await asyncio.to_thread(check_base_model_source, model.base_model)
            lock = RunLock(store.dir)
            lock.acquire()
            try:
                entry = await self._start_model(model, store, settings, lock, plan)
            except BaseException:
                lock.release()
                if not self._models:
                    await self._stop_service()
                raise
            self._models[key] = entry
            logger.info("registered %s at step %d (%s)", model.name, entry.step, store.dir)
        self._ensure_watchdog()

    async def _start_model(
        self, model: Any, store: ModelStore, settings: ModelSettings, lock: RunLock, plan: ServingPlan
    ) -> RegisteredModel:
        """Write the model's files, start its trainer (resuming its checkpoint) and serve its step."""
        model.base_path = self._path  # as ART's LocalBackend: model.log() writes where we do
        await asyncio.to_thread(write_model_files, store, model, settings.template_text)
        await self._ensure_service(plan, model.base_model, store)
        assert self._steps is not None
        trainer = TrainerProcess(
            model.base_model,
            store.checkpoints_dir,
            settings.trainer,
            gpu_ids=list(plan.training_gpu_ids),
            log_path=store.trainer_log,
            env={**plan.trainer_env, **(self._mps.client_env if self._mps is not None else {})},
        )
        try:
            step = await self._steps.start(trainer)
            entry = RegisteredModel(model, store, trainer, step, lock)
            await self._steps.serve(entry, step)
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
        """`<name>@<step>` (when `step` is None: the step an adapter lease of this task holds, else the
        current step), in the form the client sends (see `InferenceService.client_name`)."""
        if not getattr(model, "trainable", False):
            return model.inference_model_name or model.name
        if step is None:
            step = pinned_step(model.name)
        if step is None:
            step = self._entry(model).step
        name = served_name(model.name, step)
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
        """Delete every checkpoint not in `steps_to_keep`, never the current step nor a leased one;
        adapters of deleted steps are unloaded first (after their requests in flight finish)."""
        entry = self._entry(model)
        async with self._lock:
            assert self._service is not None
            keep = {*steps_to_keep, entry.step, *steps_of(model.name, self._service.leased())}
            doomed = [s for s in entry.store.checkpoint_steps() if s not in keep]
            for step in doomed:
                await self._service.remove_adapter(served_name(model.name, step))
            await asyncio.to_thread(entry.store.delete_checkpoints, doomed)

    # --- pipelined training (ART's PipelineTrainer) ------------------------------------------------------
    @contextlib.asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """Inside the block, `model.get_inference_name()` names `step` (in this task) and its adapter stays
        loaded and routed, even while `train()` publishes newer steps: a rollout finishes on the policy
        it started with. ART's PipelineTrainer wraps every rollout in one."""
        entry = self._entry(model)
        assert self._service is not None
        entry.pipelined = True
        async with pin_step(model.name, step):
            if self._pipelining_problem() is not None:
                yield  # train() refuses; the server is left as the weight sync and the handoff want it
                return
            checkpoint = entry.store.checkpoint_dir(step)  # loaded (checked first) if it is not now
            async with self._service.lease(served_name(model.name, step), checkpoint):
                yield

    async def prune_model_adapters(self, model: Any, *, retain_steps: set[int]) -> None:
        """Unload the model's adapters except `retain_steps`, the current step and the leased ones (ART's
        PipelineTrainer calls it after each step with the steps rollouts may still use)."""
        entry = self._entry(model)
        assert self._service is not None
        keep = {*retain_steps, entry.step}
        slots = self.sglang_config.max_loras_per_batch
        if len(keep) > slots and not entry.warned_pool:
            entry.warned_pool = True
            logger.warning(
                "%s: rollouts may use adapters of %d steps at once but the server batches at most %d "
                "(max_loras_per_batch), so some wait for a slot: set SGLangConfig(max_steps_off_policy=%d)",
                model.name, len(keep), slots, len(keep) - 1,
            )  # fmt: skip
        await self._service.prune(served_prefix(model.name), {served_name(model.name, step) for step in keep})

    def _pipelining_problem(self) -> str | None:
        return pipelining_problem(
            self.handoff_strategy,
            gateway=self._request.gateway,
            weight_sync=self.sglang_config.weight_sync_method,
        )

    async def train(self, model: Any, trajectory_groups: Iterable[Any], **options: Any) -> LocalTrainResult:
        """One RL step on `trajectory_groups`; returns once `<name>@<new step>` answers requests.

        Keywords are ART 0.5.18 `LocalBackend.train`'s, with its defaults (loss_fn="cispo",
        learning_rate=5e-6, ...): see `TrainOptions` (docs/configuration.md lists them). Options and groups
        are checked before anything starts (`ConfigError`, `TrainingInputError`). In shared mode the server
        gives the GPU to the trainer for the step. The step number advances on every call, as in ART (a
        batch without learning signal gets a copy of the last checkpoint), and the new step is served. A step
        the trainer refuses (non-finite values, an unwritable checkpoint), or whose adapter does not answer
        a short generation with finite logprobs, raises `TrainingError`; the served step stays.
        """
        self._check_open()
        train_options = TrainOptions.from_keywords(options)
        # Converted and checked once, here, before the GPU handoff: bad input never takes the server away.
        groups = check_groups(coerce_groups(trajectory_groups), **train_options.input_rules())
        entry = self._entry(model)
        check_off_policy(groups, model.name, entry.step, self.sglang_config.max_steps_off_policy)
        check_row_length(train_options, entry.trainer.config)
        if entry.pipelined and (problem := self._pipelining_problem()) is not None:
            raise ConfigError(
                f"pipelined training (rollouts hold adapter leases while train() runs): {problem}"
            )
        self._ensure_watchdog()
        steps = self._steps
        assert steps is not None
        async with self._lock:
            started = time.monotonic()
            verbose = train_options.verbose
            with StepProgress(model.name, entry.step, not (verbose or sys.stderr.isatty())) as bar:
                outcome, timings = await steps.run(
                    entry,
                    lambda trainer: trainer.train(groups, train_options, on_progress=bar),
                    learning_rate=train_options.learning_rate,
                )
            warn_about(entry, outcome)
            timings["time/step_s"] = time.monotonic() - started
            metrics = {**outcome.metrics, **timings, **steps.prefill_counts_since_last_step()}
            await record_step(model, entry.store.history, entry.step, metrics)
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
        reports them, and ends once `<name>@<new step>` answers requests (`config`: see `prepare_sft`).

        Input is checked before anything starts; the training (handoff, trainer, weight sync) runs as one
        task, so a caller that stops iterating early does not leave the step half done."""
        self._check_open()
        wire = [coerce_trajectory(t, index).model_dump(mode="python") for index, t in enumerate(trajectories)]
        batches = prepare_sft(wire, config, dev_config)
        entry = self._entry(model)
        self._ensure_watchdog()
        async for report in reports_while(lambda report: self._run_sft(entry, batches, report, verbose)):
            yield report

    async def _run_sft(
        self, entry: RegisteredModel, batches: list[SFTBatch], report: Any, verbose: bool
    ) -> None:
        assert self._steps is not None
        async with self._lock:
            _, timings = await self._steps.run(
                entry,
                lambda t: t.sft(batches, on_progress=lambda event: report(event.get("metrics") or {})),
                learning_rate=max(batch.learning_rate for batch in batches),
            )
            if verbose:
                logger.info("%s SFT step %d: %s", entry.model.name, entry.step, json.dumps(timings))

    async def _log(self, model: Any, trajectory_groups: list[Any], split: str = "val") -> None:
        """Store the groups that `model.log()` recorded under `trajectories/<split>/<step>.jsonl`."""
        store = ModelStore(self._path, model.project, model.name)
        step = await self._get_step(model)
        lines = [group.model_dump_json() for group in coerce_groups(trajectory_groups)]
        await asyncio.to_thread(append_lines, store.trajectories_file(split, step), lines)

    async def close(self) -> None:
        """Stop the server, the gateway and every trainer. Idempotent; also done at interpreter exit by
        the process handles themselves."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            await self._watchdog.stop()
        try:
            await self._stop_service(*(entry.trainer.stop() for entry in self._models.values()))
        finally:
            for entry in self._models.values():
                entry.lock.release()

    async def _stop_service(self, *stops: Awaitable[Any]) -> None:
        """Stop the server and its gateway with `stops` (the trainers), then their CUDA MPS daemon."""
        service, mps = self._service, self._mps
        self._service = self._steps = self._watchdog = self._mps = self._plan = None
        try:
            await gather_all(*stops, *([service.close()] if service is not None else []))
        finally:
            if mps is not None:
                await mps.stop()

    async def __aenter__(self) -> SGLangBackend:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # --- crash recovery --------------------------------------------------------------------------------
    def _ensure_watchdog(self) -> None:
        """Restart a server that died, at any time (during train() too): see `ServerWatchdog`."""
        if self._watchdog is not None:
            self._watchdog.ensure_running()

    # --- helpers ---------------------------------------------------------------------------------------
    @property
    def inference(self) -> InferenceService | None:
        """The inference service (server, gateway, loaded adapters), once a model is registered."""
        return self._service

    def trainer(self, model: Any) -> TrainerProcess:
        """The registered model's trainer worker process (its pid, whether it is alive, its config)."""
        return self._entry(model).trainer

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this SGLangBackend is closed: create a new one")

    def _entry(self, model: Any) -> RegisteredModel:
        entry = self._models.get((model.project, model.name))
        if entry is None:
            raise ModelNotRegisteredError(
                f"model {model.name!r} is not registered with this backend: "
                "call `await model.register(backend)` first"
            )
        return entry

    async def _ensure_service(self, plan: ServingPlan, base_model: str, store: ModelStore) -> None:
        """Assemble serving from the plan, once: the server's log lives with the first model registered
        (one server serves every model)."""
        if self._service is None:
            self._plan = plan
            if plan.cuda_mps:
                self._mps = await start_daemon(self._request.cuda_mps, store.logs_dir / "cuda-mps.log")
            env = self._mps.client_env if self._mps is not None else {}
            self._service = InferenceService(
                plan, base_model, log_path=store.server_log, use_gateway=self._request.gateway, env=env,
                placement=ray_cluster,
            )  # fmt: skip
            if SYNC_TRAITS[plan.weight_sync].serves_older_steps:
                self._service.serve_on_demand(lambda name: checkpoint_of(self._models.values(), name))
            self._steps = StepRunner.for_plan(plan, self._service)
            self._watchdog = ServerWatchdog(self._service.servers)


# help(SGLangBackend.train) and editors that read __signature__ show every option with its default.
SGLangBackend.train.__signature__ = TrainOptions.signature(inspect.signature(SGLangBackend.train))  # type: ignore[attr-defined]
