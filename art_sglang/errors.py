"""Exception classes raised by art_sglang. Every error a user can act on has its own class."""

from __future__ import annotations


class ArtSGLangError(Exception):
    """Base class of every error raised by art_sglang."""


class ConfigError(ArtSGLangError, ValueError):
    """A configuration cannot work (e.g. the same GPU for inference and training in split mode)."""


class ServerStartError(ArtSGLangError):
    """The inference server exited or did not become healthy in time. The message holds the log tail."""


class ServerCrashedError(ArtSGLangError):
    """The inference server process died while it was expected to serve."""


class ServerRequestError(ArtSGLangError):
    """The server answered an admin request with an error.

    ``status`` is the HTTP status and ``server_message`` the server's own explanation.
    """

    def __init__(self, message: str, *, status: int | None = None, server_message: str | None = None):
        super().__init__(message)
        self.status = status
        self.server_message = server_message


class ServerUnavailableError(ServerRequestError):
    """The server could not be reached (connection refused or reset, or no answer in time)."""


class AdapterOperationTimeoutError(ServerUnavailableError):
    """An adapter load or unload did not finish within its bound (`unresponsive_timeout`): SGLang keeps the
    operation waiting, holding the lock every later one takes, so the server is restarted."""


class AdapterLoadError(ServerRequestError):
    """``/load_lora_adapter`` refused the adapter (duplicate name, bad path, rank above the maximum, ...)."""


class AdapterNotLoadedError(ServerRequestError):
    """A request named an adapter the server does not have loaded."""


class TrainingInputError(ArtSGLangError, ValueError):
    """Trajectory groups that cannot be trained on; the message names the group and trajectory index."""


class TrainerError(ArtSGLangError):
    """The trainer worker failed or died. The message holds its error or log tail."""


class TrainingError(TrainerError):
    """A training step was refused and not applied: its loss, gradient norm or new weights were not
    finite, its checkpoint could not be written, or its adapter did not answer what rollouts ask (a short
    generation with finite logprobs). The trainer stays at its last checkpoint (weights, optimizer state
    and step number) and keeps serving; the message names the cause."""


class ModelNotRegisteredError(ArtSGLangError, ValueError):
    """A model method that needs a backend was called before ``await model.register(backend)``.

    A ``ValueError`` as well, because ART raises ``ValueError`` in this case.
    """
