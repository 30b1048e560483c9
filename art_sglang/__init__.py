"""art_sglang: ART-style RL training backend with inference on SGLang.

`import art_sglang as art` gives the names an OpenPipe ART 0.5.x program uses, plus `SGLangBackend`.
"""

from __future__ import annotations

from .backend import SGLangBackend
from .backend_protocol import Backend
from .config import ClusterConfig, DeviceConfig, SGLangConfig, TrainerConfig
from .errors import (
    AdapterLoadError,
    AdapterNotLoadedError,
    AdapterOperationTimeoutError,
    ArtSGLangError,
    ConfigError,
    ModelNotRegisteredError,
    ServerCrashedError,
    ServerRequestError,
    ServerStartError,
    ServerUnavailableError,
    TrainerError,
    TrainingError,
    TrainingInputError,
)
from .gather import gather_trajectory_groups
from .model import Model, TrainableModel
from .trajectories import History, Trajectory, TrajectoryGroup
from .types import (
    LocalTrainResult,
    Message,
    MessageOrChoice,
    Messages,
    MessagesAndChoices,
    Tools,
    TrainConfig,
    TrainResult,
    TrainSFTConfig,
)

__all__ = [
    "AdapterLoadError",
    "AdapterNotLoadedError",
    "AdapterOperationTimeoutError",
    "ArtSGLangError",
    "Backend",
    "ClusterConfig",
    "ConfigError",
    "DeviceConfig",
    "History",
    "LocalTrainResult",
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
    "ServerUnavailableError",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "TrainerConfig",
    "TrainerError",
    "TrainingError",
    "TrainingInputError",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectory_groups",
]
