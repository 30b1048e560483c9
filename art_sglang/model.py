"""`Model` and `TrainableModel`, with the fields and methods of OpenPipe ART 0.5.x.

The model is the user's handle; the backend does the work: what a model needs from it is the `Backend`
protocol (backend_protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI, Timeout
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator
from pydantic_core import PydanticSerializationError

from .backend_protocol import Backend
from .errors import ConfigError, ModelNotRegisteredError
from .serving.served_names import served_name
from .storage.history import append_row, read_rows
from .storage.model_store import HISTORY_FILE, name_problem
from .tracking import WandbReporter, metric_key
from .training.options import TrainOptions
from .trajectories import Trajectory, TrajectoryGroup
from .types import TrainConfig, TrainResult, TrainSFTConfig

logger = logging.getLogger(__name__)


class Model(BaseModel):
    """A model rollouts can call: a prompted one (set the `inference_*` fields yourself) or, as the
    `TrainableModel` subclass, one a backend trains and serves."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    config: Any = None
    trainable: bool = False
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None  # sent instead of `name` when set
    base_path: str = ".art"
    report_metrics: list[str] | None = None  # as ART: None = W&B when WANDB_API_KEY is set; [] = off

    _backend: Backend | None = PrivateAttr(None)
    _wandb: WandbReporter | None = PrivateAttr(None)
    _openai_client: AsyncOpenAI | None = PrivateAttr(None)
    _openai_client_key: tuple[str, str] | None = PrivateAttr(None)

    @field_validator("name", "project")
    @classmethod
    def _usable_in_paths(cls, value: str) -> str:
        problem = name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    def backend(self) -> Backend:
        if self._backend is None:
            raise ModelNotRegisteredError(
                f"model {self.name!r} has no backend yet: call `await model.register(backend)` first"
            )
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Attach the model to a backend (ART: `await model.register(backend)`)."""
        try:
            self.model_dump_json()
        except PydanticSerializationError as exc:
            raise ConfigError(
                f"model {self.name!r}: `config` must be JSON-serializable (it is saved to model.json): {exc}"
            ) from exc
        self._backend = backend
        try:
            await backend.register(self)
        except BaseException:
            self._backend = None
            raise

    def openai_client(self) -> AsyncOpenAI:
        """An `AsyncOpenAI` client for the model's inference server (created once per server address)."""
        if self.inference_base_url is None or self.inference_api_key is None:
            if self.trainable:
                raise ModelNotRegisteredError(
                    f"model {self.name!r} has no inference server yet: "
                    "call `await model.register(backend)` before `model.openai_client()`"
                )
            raise ConfigError(
                f"model {self.name!r}: set `inference_base_url` and `inference_api_key` to get a client"
            )
        key = (self.inference_base_url, self.inference_api_key)
        if self._openai_client is None or self._openai_client_key != key:
            client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key,
                # Long generations queue behind many concurrent rollouts: the default 10 min read timeout
                # cuts them short (ART uses 20 min); a server that is not there should fail fast.
                timeout=Timeout(1200.0, connect=5.0),
            )
            kwargs = self._chat_template_kwargs()
            # As ART's client: chat requests render with the model's chat_template_kwargs, the same ones
            # the trainer tokenizes with.
            self._openai_client = client if kwargs is None else _TemplateKwargsClient(client, kwargs)  # type: ignore[assignment]
            self._openai_client_key = key
        return self._openai_client  # type: ignore[return-value]

    def _chat_template_kwargs(self) -> dict[str, Any] | None:
        return None

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model=` to send: the backend's name for the step (latest when None)."""
        if self._backend is not None and hasattr(self._backend, "_model_inference_name"):
            return self._backend._model_inference_name(self, step=step)
        name = self.inference_model_name or self.name
        return name if step is None else served_name(name, step)

    async def get_step(self) -> int:
        """The latest trained step (0 for models that are not trainable)."""
        return 0

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup] | Iterable[Trajectory | BaseException] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Record trajectories (e.g. a validation run) and/or metrics under `split` at the current step.

        As in ART 0.5.x the model writes the row itself: averages of the groups (`<split>/reward`,
        `<split>/exception_rate`, `<split>/reward_std_dev`, each trajectory metric) plus `metrics`,
        appended to `history.jsonl` in the model's output directory. A backend that defines
        `_log(model, groups, split)` then also receives the groups (e.g. to store the trajectories).
        """
        groups = _as_groups(trajectories)
        row = {metric_key(key, split): value for key, value in _summarize(groups).items()}
        # ART's names: keys that already name a section or split ("loss/train", "time/step_s") are kept.
        row.update({metric_key(key, split): value for key, value in (metrics or {}).items()})
        if row:
            step = await self.get_step() if step is None else step
            written = await asyncio.to_thread(
                append_row, Path(self._get_output_dir()) / HISTORY_FILE, step, row
            )
            await self._report(step, written)
        backend_log = getattr(self._backend, "_log", None)
        if backend_log is not None and groups:
            await backend_log(self, groups, split)

    async def _report(self, step: int, row: dict[str, Any]) -> None:
        """Mirror a history row to W&B when reporting is on (see art_sglang.tracking)."""
        if self._wandb is None:
            self._wandb = WandbReporter(self.project, self.name, self.report_metrics)
        if self._wandb.enabled:
            await asyncio.to_thread(self._wandb.report, step, row)

    def _get_output_dir(self) -> str:
        """`<base_path>/<project>/models/<name>` (a str, as in ART)."""
        return f"{self.base_path}/{self.project}/models/{self.name}"


class TrainableModel(Model):
    """A model trained by a backend on top of `base_model` (a Hugging Face id or local path).

    `_internal_config` takes ART's `art.dev.InternalModelConfig` (a dict: `peft_args`, `init_args`,
    `trainer_args`, `engine_args`, `chat_template*`, `*_gpu_ids`); the backend maps every key it has an
    equivalent for and refuses the others at register.
    """

    base_model: str
    trainable: bool = True

    _internal_config: dict[str, Any] | None = PrivateAttr(None)

    def __init__(self, *, _internal_config: Mapping[str, Any] | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._internal_config = dict(_internal_config) if _internal_config is not None else None

    def _chat_template_kwargs(self) -> dict[str, Any] | None:
        kwargs = (self._internal_config or {}).get("chat_template_kwargs")
        return dict(kwargs) if kwargs is not None else None

    async def register(self, backend: Backend, _openai_client_config: Any | None = None) -> None:
        """Attach to the backend, which starts serving the latest checkpoint, and point the model at it."""
        try:
            await super().register(backend)
            base_url, api_key = await backend._prepare_backend_for_training(self, _openai_client_config)
        except BaseException:
            # A model whose registration failed must not keep pointing at an earlier server.
            self._backend = None
            self.inference_base_url = self.inference_api_key = self.inference_model_name = None
            raise
        self.inference_base_url = base_url
        self.inference_api_key = api_key
        self.inference_model_name = backend._model_inference_name(self)

    def get_inference_name(self, step: int | None = None) -> str:
        # Before register there is no served adapter; falling back to the bare name would send rollouts
        # to the base model without any error.
        return self.backend()._model_inference_name(self, step=step)

    async def get_step(self) -> int:
        return await self.backend()._get_step(self)

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> TrainResult:
        """Older ART style: `await model.train(groups, config=TrainConfig(...), _config={...})`.

        Same as `await backend.train(model, groups, learning_rate=..., kl_penalty_coef=..., verbose=...,
        **_config)`; `_config` is ART's `dev.TrainConfig` (the train() keywords, with `ppo: bool` for
        loss_fn).
        """
        config = config or TrainConfig()
        keywords = {"learning_rate": config.learning_rate, "kl_penalty_coef": config.kl_penalty_coef}
        keywords.update(TrainOptions.from_dev_config(_config or {}))
        return await self.backend().train(self, list(trajectory_groups), verbose=verbose, **keywords)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        """Supervised fine-tuning on `trajectories` (their assistant messages are the targets), as ART's
        `model.train_sft`: one optimizer step per batch, one new step (checkpoint and served adapter) per
        call, and the batches' averaged metrics appended to history.jsonl under `train/`."""
        config = config or TrainSFTConfig()
        started = time.monotonic()
        samples = [
            metrics
            async for metrics in self.backend()._train_sft(self, trajectories, config, _config or {}, verbose)
        ]
        if samples:
            averaged = {key: statistics.fmean(s[key] for s in samples if key in s) for key in samples[0]}
            averaged["time/step_trainer_s"] = time.monotonic() - started
            await self.log(None, split="train", metrics=averaged, step=await self.get_step())

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> None:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric` (highest mean
        per step in history.jsonl)."""
        backend = self.backend()
        steps_to_keep = [await self.get_step()]
        history = Path(self._get_output_dir()) / HISTORY_FILE
        best = await asyncio.to_thread(best_step, history, best_checkpoint_metric)
        if best is not None:
            steps_to_keep.append(best)
        await backend._delete_checkpoint_files(self, sorted(set(steps_to_keep)))


class _TemplateKwargsClient:
    """An `AsyncOpenAI` client whose chat completions carry `chat_template_kwargs` in their body (a value
    the caller passes in `extra_body` wins); everything else is the client's own."""

    def __init__(self, client: AsyncOpenAI, kwargs: dict[str, Any]) -> None:
        self._client = client
        self._kwargs = kwargs

    @property
    def chat(self) -> Any:
        return _Namespace(
            self._client.chat, completions=_Completions(self._client.chat.completions, self._kwargs)
        )

    def with_options(self, **options: Any) -> _TemplateKwargsClient:
        return _TemplateKwargsClient(self._client.with_options(**options), self._kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Completions:
    def __init__(self, completions: Any, kwargs: dict[str, Any]) -> None:
        self._completions = completions
        self._kwargs = kwargs

    async def create(self, *args: Any, **params: Any) -> Any:
        extra = dict(params.pop("extra_body", None) or {})
        extra.setdefault("chat_template_kwargs", self._kwargs)
        return await self._completions.create(*args, extra_body=extra, **params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._completions, name)


class _Namespace:
    """`wrapped` with some attributes replaced."""

    def __init__(self, wrapped: Any, **replaced: Any) -> None:
        self._wrapped = wrapped
        self._replaced = replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._wrapped, name)


def best_step(history: Path, metric: str) -> int | None:
    """The step whose mean `metric` in a history.jsonl is highest (the later step on a tie); None, with a
    warning, when the file or the metric is missing."""
    if not history.exists():
        logger.warning("%s not found: keeping only the latest checkpoint", history)
        return None
    values: dict[int, list[float]] = defaultdict(list)
    for row in read_rows(history):
        value = row.get(metric)
        if isinstance(value, (int, float)) and "step" in row and not math.isnan(value):
            values[int(row["step"])].append(float(value))
    if not values:
        logger.warning("no %r in %s: keeping only the latest checkpoint", metric, history)
        return None
    return max(values, key=lambda step: (statistics.fmean(values[step]), step))


def _as_groups(
    trajectories: Iterable[TrajectoryGroup] | Iterable[Trajectory | BaseException] | None,
) -> list[TrajectoryGroup]:
    items = list(trajectories or [])
    if all(isinstance(item, TrajectoryGroup) for item in items):
        return items  # type: ignore[return-value]
    if all(isinstance(item, (Trajectory, BaseException)) for item in items):
        return [TrajectoryGroup(items)]
    raise TypeError("log() takes TrajectoryGroup objects, or Trajectory objects and exceptions")


def _summarize(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Averages over all trajectories of the groups, named as in ART's history rows (before the split)."""
    if not groups:
        return {}
    trajectories = [t for g in groups for t in g.trajectories]
    failures = sum(len(g.exceptions) for g in groups)
    summary: dict[str, float] = {}
    if trajectories:
        summary["reward"] = statistics.fmean(t.reward for t in trajectories)
    if trajectories or failures:
        summary["exception_rate"] = failures / (len(trajectories) + failures)
    stds = [statistics.pstdev(t.reward for t in g) for g in groups if len(g) > 1]
    if stds:
        summary["reward_std_dev"] = statistics.fmean(stds)
    per_metric: dict[str, list[float]] = defaultdict(list)
    for trajectory in trajectories:
        for name, value in trajectory.metrics.items():
            per_metric[name].append(float(value))
    summary.update({name: statistics.fmean(values) for name, values in per_metric.items()})
    return summary
