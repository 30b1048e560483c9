"""art_sglang: ART-style RL training backend with inference on SGLang.

`import art_sglang as art` gives the names an OpenPipe ART 0.5.x program uses, plus `SGLangBackend`.
"""

from __future__ import annotations

from typing import Any

from .config import DeviceConfig, SGLangConfig, TrainerConfig
from .errors import (
    AdapterLoadError,
    AdapterNotLoadedError,
    ArtSGLangError,
    ConfigError,
    ModelNotRegisteredError,
    ServerCrashedError,
    ServerRequestError,
    ServerStartError,
    TrainerError,
    TrainingInputError,
)
from .gather import gather_trajectory_groups
from .model import Backend, Model, TrainableModel
from .trajectories import History, Trajectory, TrajectoryGroup
from .types import Message, MessageOrChoice, Messages, MessagesAndChoices, Tools, TrainConfig, TrainResult

__all__ = [
    "AdapterLoadError",
    "AdapterNotLoadedError",
    "ArtSGLangError",
    "Backend",
    "ConfigError",
    "DeviceConfig",
    "History",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "ModelNotRegisteredError",
    "SGLangBackend",
    "SGLangConfig",
    "ServerCrashedError",
    "ServerRequestError",
    "ServerStartError",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainerConfig",
    "TrainerError",
    "TrainingInputError",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectory_groups",
]


def __getattr__(name: str) -> Any:
    # The backend pulls in the server and trainer modules; importing it on first use keeps
    # `import art_sglang` light for code that only builds trajectories.
    if name == "SGLangBackend":
        from .backend import SGLangBackend

        return SGLangBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
