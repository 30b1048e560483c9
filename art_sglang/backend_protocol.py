"""`Backend`: what models call on their backend, the same methods ART's own models call, so `SGLangBackend`
serves both `art_sglang.TrainableModel` and `art.TrainableModel`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .trajectories import Trajectory, TrajectoryGroup
    from .types import TrainResult, TrainSFTConfig


class ModelRef(Protocol):
    """What a backend is handed: an `art_sglang.Model`/`TrainableModel` or ART's (model.py imports this
    module, so the models are named by what every backend reads of them)."""

    name: str
    project: str
    trainable: bool


class Backend(Protocol):
    """What models call on their backend (ART 0.5.x's `art.Backend`).

    Optional: `async def _log(model, trajectory_groups, split) -> None`; when a backend defines it,
    `Model.log` hands it the logged groups after writing the history row.
    """

    async def register(self, model: ModelRef) -> None: ...

    async def _prepare_backend_for_training(
        self, model: ModelRef, config: Any | None
    ) -> tuple[str, str]: ...  # (OpenAI base_url ending in /v1, api_key)

    def _model_inference_name(self, model: ModelRef, step: int | None = None) -> str: ...

    async def _get_step(self, model: ModelRef) -> int: ...

    async def _delete_checkpoint_files(self, model: ModelRef, steps_to_keep: list[int]) -> None: ...

    async def train(
        self, model: ModelRef, trajectory_groups: Iterable[TrajectoryGroup], **options: Any
    ) -> TrainResult: ...

    def _train_sft(
        self,
        model: ModelRef,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig,
        dev_config: dict[str, Any],
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]: ...  # one metrics dict per batch

    async def close(self) -> None: ...
