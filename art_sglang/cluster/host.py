"""`ReplicaHost`: what runs on a node for one replica, as a Ray actor — it starts the inference server
(SGLang from that node's server venv, or the reference engine) as a subprocess with `ServerProcess`, keeps
the node-local folder adapters are written into, and reports the server's URL, its exit and checksums of
what it wrote. It never imports SGLang: the server is another process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray

from ..config import SGLangConfig
from ..errors import ServerStartError
from ..process_tree import LOG_TAIL_LINES
from ..server_defaults import find_server_python
from ..serving.servers.process import Engine, ServerProcess
from .files import AdapterBytes, remove_adapter, write_adapter

_EXIT_POLL_S = 0.2
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ReplicaHost:
    """One replica's server on this node (an async actor: its calls interleave on one event loop, the
    thread that starts the server, so the server dies with the actor)."""

    def __init__(self, adapter_root: str | None) -> None:
        actor = ray.get_runtime_context().get_actor_id() or "local"
        self._folder = Path(adapter_root or tempfile.gettempdir()) / f"art-sglang-replica-{actor[:16]}"
        self._server: ServerProcess | None = None

    def ready(self) -> str:
        """The node this actor was placed on (answers once it is placed)."""
        return ray.get_runtime_context().get_node_id()

    async def start(
        self, config: dict[str, Any], base_model: str, engine: Engine, admin_key: str, env: dict[str, str]
    ) -> dict[str, Any]:
        """Start the server bound to this node's address; returns where it is and what it runs."""
        node_ip = ray.util.get_node_ip_address()
        settings = SGLangConfig.model_validate(config)
        updates: dict[str, Any] = {}
        if settings.host in _LOOPBACK:  # the router on the head must reach it
            updates["host"] = node_ip
        if engine == "sglang" and settings.server_python is None:
            here = Path(__file__).resolve().parent
            python = find_server_python() or find_server_python(here)
            if python is None:
                raise ServerStartError(
                    f"node {node_ip} has no .venv-sglang-server next to art_sglang ({here}) or in the working "
                    "folder: build it there with scripts/setup_sglang.sh, or set ART_SGLANG_SERVER_PYTHON"
                )
            updates["server_python"] = python
        settings = settings.model_copy(update=updates)
        # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it gave this actor; the reference engine gets none.
        server = ServerProcess(
            settings,
            base_model,
            engine=engine,
            log_path=self._folder / "server.log",
            gpu_ids=None if engine == "sglang" else [],
            admin_api_key=admin_key,
            env=env,
        )
        self._server = server
        async with one_start_per_gpu(os.environ.get("CUDA_VISIBLE_DEVICES") if engine == "sglang" else None):
            await server.start()
        host = node_ip if settings.host in ("0.0.0.0", "::", "") else settings.host
        return {
            "url": f"http://{host}:{server.port}",
            "node_ip": node_ip,
            "node_id": self.ready(),
            "pid": server.pid,
            "log_path": str(server.log_path),
            "adapter_dir": str(self._adapters),
        }

    @property
    def _adapters(self) -> Path:
        return self._folder / "adapters"

    async def wait_exit(self) -> int | None:
        """Returns once the server exited (its exit code). The head keeps this call pending: its failure
        is how the head learns that this actor or its node died."""
        while self._server is not None and self._server.is_alive():
            await asyncio.sleep(_EXIT_POLL_S)
        return self._server.exit_code() if self._server is not None else None

    async def stage(self, name: str, files: AdapterBytes) -> tuple[str, str]:
        """Write an adapter's files into this node's folder; (its path here, checksum of what is on disk)."""
        path, digest = await asyncio.to_thread(write_adapter, self._adapters, name, files)
        return str(path), digest

    async def drop(self, name: str) -> None:
        """Delete an adapter the server no longer holds."""
        await asyncio.to_thread(remove_adapter, self._adapters, name)

    async def stop(self, timeout: float) -> None:
        """Stop the server and delete the adapters (the log stays, for a look after the run)."""
        if self._server is not None:
            await self._server.stop(timeout=timeout)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, self._adapters, True)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return self._server.log_tail(lines) if self._server is not None else ""


@contextlib.asynccontextmanager
async def one_start_per_gpu(gpus: str | None) -> AsyncIterator[None]:
    """Hold this machine's lock for `gpus` (CUDA_VISIBLE_DEVICES as Ray set it; None: no GPU, no lock)
    while a server starts. SGLang sizes its memory from what is free on the GPU when it starts, so a replica
    starting while another on the same GPU allocates can find nothing left for its KV cache (seen on an
    H100 with two replicas on one GPU: "Loaded weights leave no GPU memory for the KV cache"). Replicas
    Ray packs onto one GPU (a fractional `gpus_per_replica`) therefore start one after the other; a file
    lock, because each replica is its own actor process, and the kernel drops it if that process dies."""
    if not gpus:
        yield
        return
    path = Path(tempfile.gettempdir()) / f"art-sglang-gpu-start-{gpus.replace(',', '_')}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
