"""`CudaMps`: a private CUDA MPS control daemon for processes that share one GPU at the same time.

Without MPS, processes on one GPU get time slices of it in turn, so a co-resident server and trainer
(shared_strategy "co_resident") cannot run their kernels side by side: the small decode kernels of a
rollout batch leave most of the GPU idle during their slice. Under MPS their kernels run concurrently.

The daemon is the backend's own child: its pipe directory is private (other MPS users on the machine are
not touched), only the processes given `client_env` use it, it runs in the foreground so it dies with
the backend (parent-death signal), and `stop()` asks it to quit once its clients are gone. The directory
is named after the backend's pid, so a later start removes what a killed backend left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from .config import CudaMpsMode
from .errors import ConfigError
from .process_tree import ManagedProcess

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
DIR_PREFIX = "art-sglang-mps-"
START_TIMEOUT_S = 15.0
QUIT_TIMEOUT_S = 10.0


def control_program() -> str | None:
    """The MPS control program on PATH (shipped with the NVIDIA driver), or None."""
    return shutil.which(CONTROL)


def remove_dirs_of_dead_backends() -> None:
    """Remove this user's daemon directories whose backend process is gone (killed before `stop()`)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        owner = directory.name.removeprefix(DIR_PREFIX).split("-")[0]
        try:
            mine = directory.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(directory, ignore_errors=True)


class CudaMps(ManagedProcess):
    """One MPS control daemon; `client_env` is what a process needs in its environment to be its client."""

    def __init__(self, log_path: Path) -> None:
        super().__init__("CUDA MPS control daemon", log_path)
        self._dir: Path | None = None

    @property
    def client_env(self) -> dict[str, str]:
        assert self._dir is not None, "start() first"
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self._dir / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self._dir / "log"),
        }

    def _daemon_env(self) -> dict[str, str]:
        env = {**os.environ, **self.client_env}
        # The daemon sees the machine's GPUs as the system numbers them, so a client's CUDA_VISIBLE_DEVICES
        # (system indices or UUIDs, as the backend gives them) picks the same GPU through MPS as without.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return env

    async def start(self) -> dict[str, str]:
        """Start the daemon and wait for its control socket; returns `client_env`. ConfigError if the
        control program is missing or the daemon does not come up (its log tail says why)."""
        program = control_program()
        if program is None:
            raise ConfigError(f"cuda_mps='on' needs {CONTROL} (part of the NVIDIA driver) on PATH")
        remove_dirs_of_dead_backends()
        # Under /tmp: a Unix socket's path may not exceed 107 bytes, and a model directory's can.
        self._dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        for sub in ("pipe", "log"):
            (self._dir / sub).mkdir()
        self._launch([program, "-f"], self._daemon_env(), pipes=False)
        control = self._dir / "pipe" / "control"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not control.exists():
            if not self.is_alive() or time.monotonic() > deadline:
                what = (
                    "exited" if not self.is_alive() else f"made no control socket in {START_TIMEOUT_S:.0f} s"
                )
                message = self.describe_death(what)
                await self.stop()
                raise ConfigError(f"CUDA MPS could not start: {message}\nUse cuda_mps='off'.")
            await asyncio.sleep(0.05)
        logger.info("CUDA MPS: the co-resident server and trainer share the GPU's compute (%s)", self._dir)
        return self.client_env

    async def stop(self) -> None:
        """Ask the daemon to quit (its clients should be gone by now), then clear its tree and directory.
        Idempotent."""
        if self.is_alive():
            await asyncio.to_thread(self._quit)
        await self._terminate(QUIT_TIMEOUT_S)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _quit(self) -> None:
        program = control_program()
        if program is None:
            return
        try:
            subprocess.run(
                [program], input=b"quit\n", env=self._daemon_env(), timeout=QUIT_TIMEOUT_S, check=False,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            logger.warning("CUDA MPS daemon did not take 'quit' in %.0f s; killing it", QUIT_TIMEOUT_S)
            return
        deadline = time.monotonic() + QUIT_TIMEOUT_S
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)


async def start_daemon(mode: CudaMpsMode, log_path: Path) -> CudaMps | None:
    """A started daemon for the co-resident server and trainer. One that does not start is a ConfigError
    with `mode` "on"; with "auto" a warning, and None: both go on without MPS."""
    mps = CudaMps(log_path)
    try:
        await mps.start()
    except ConfigError as exc:
        if mode == "on":
            raise
        logger.warning("%s\nGoing on without CUDA MPS: server and trainer take turns on the GPU.", exc)
        return None
    return mps
