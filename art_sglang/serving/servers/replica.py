"""`Replica`: one server of a `ServerGroup` — its process, its admin client once it was brought up, where
requests reach it, its health record and the pause before its next background restart. The process is a
`ServerHandle`: a local `ServerProcess`, or a `RemoteHandle` on another node (the group gets those from
its `RemotePlacement`: `cluster.ray_cluster`), whose adapters reach it through its `AdapterFiles`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ...config import SGLangConfig
from .client import ServerClient
from .process import Engine

# A replica whose restart failed is tried again after this pause, doubled per failure in a row up to the
# maximum (the others serve meanwhile; a start that fails for good, out of memory say, must not spin).
_RETRY_S = 5.0
_RETRY_MAX_S = 300.0


class ServerHandle(Protocol):
    """What the group uses of a server process, wherever it runs."""

    config: SGLangConfig
    label: str

    @property
    def base_url(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def keep_alive(self) -> float: ...

    def is_alive(self) -> bool: ...

    def log_tail(self, lines: int = ...) -> str: ...

    async def start(self) -> None: ...

    async def stop(self, timeout: float = ...) -> None: ...


class AdapterFiles(Protocol):
    """How an adapter on this machine becomes a path its server can load."""

    async def stage(self, name: str, path: Path) -> str:
        """The path the server loads `name` from (after copying it there, if it must be copied)."""
        ...

    async def drop(self, name: str) -> None:
        """The server unloaded `name`: delete what `stage` copied."""
        ...


class RemoteHandle(ServerHandle, AdapterFiles, Protocol):
    """A server replica on another machine, and how adapters reach it there."""


class RemotePlacement(Protocol):
    """Where the replicas of a plan with a cluster run (the nodes of a Ray cluster: `cluster.ray_cluster`
    makes one): a server per replica, placed when it starts; `close` lets go of the cluster."""

    def server(
        self,
        config: SGLangConfig,
        base_model: str,
        *,
        engine: Engine,
        admin_api_key: str,
        env: Mapping[str, str] | None,
        label: str,
    ) -> RemoteHandle: ...

    async def close(self) -> None: ...


class SameDisk:
    """A server on this machine reads the checkpoint where it is."""

    async def stage(self, name: str, path: Path) -> str:
        return str(path)

    async def drop(self, name: str) -> None:
        return None


SAME_DISK = SameDisk()


@dataclass(frozen=True)
class Server:
    """A server that is brought up, as the adapter side sees it."""

    client: ServerClient
    label: str
    api_key: str | None  # the key of its ordinary routes
    routed_url: str | None  # where requests reach it; None while it is not routed to
    files: AdapterFiles = SAME_DISK
    ranks: int = 1  # its tensor-parallel ranks: its members of a weight-update group


@dataclass(eq=False)
class Replica:
    """One server process of the group (its record is the group's alone)."""

    process: ServerHandle
    gpus: tuple[str, ...]
    configs: tuple[SGLangConfig, ...]  # configs[k]: its settings while k others run on its GPUs
    files: AdapterFiles = SAME_DISK
    client: ServerClient | None = None
    routed_url: str | None = None  # the URL requests reach it at; None while it is not routed to
    unanswered_since: float | None = None  # first failed health check in a row
    failed_restarts: int = 0  # background restarts that failed in a row
    restart_after: float = 0.0  # monotonic time before which no background restart is tried

    @property
    def up(self) -> bool:
        """Running and brought up (holds what it must hold)."""
        return self.client is not None and self.process.is_alive()

    def view(self) -> Server:
        assert self.client is not None
        config = self.process.config
        return Server(
            self.client, self.process.label, config.api_key, self.routed_url, self.files,
            config.tensor_parallel_size,
        )  # fmt: skip

    async def problem(self, *, probe: bool, timeout: float) -> str | None:
        """What is wrong: the process died, an adapter operation on it did not finish in time (SGLang
        holds the lock of every later one until it does), or (with `probe`) it has not answered health
        checks for `timeout` seconds."""
        if not self.process.is_alive():
            return "died"
        if self.client is not None and self.client.stuck_operation is not None:
            return f"is stuck in an adapter operation ({self.client.stuck_operation})"
        if not probe:
            return None
        if self.client is not None and await self.client.health(timeout=min(timeout, 10.0)):
            self.unanswered_since = None
            return None
        now = time.monotonic()
        if self.unanswered_since is None:
            self.unanswered_since = now
        if now - self.unanswered_since < timeout:
            return None
        self.unanswered_since = None
        return f"did not answer GET /health for {timeout:g} s"

    def restart_failed(self) -> float:
        """Count a failed background restart; returns the pause before the next try."""
        self.failed_restarts += 1
        pause = min(_RETRY_S * 2 ** (self.failed_restarts - 1), _RETRY_MAX_S)
        self.restart_after = time.monotonic() + pause
        return pause


def replica_log(log_path: Path, n: int) -> Path:
    """Replica n's server log: the server log itself for the first, `server-replica<n>.log` for others."""
    return log_path if n == 0 else log_path.with_name(f"{log_path.stem}-replica{n}{log_path.suffix}")
