"""One live backend per model directory: an exclusive `flock` on `<model dir>/.lock`, held while the
model is registered and released by the kernel when the process dies (no stale lock after a crash).

Two backends training the same model would both write `checkpoints/<step>/` and serve different
weights under the same name; the second one is refused at register, naming the process that holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from ..errors import ConfigError

LOCK_FILE = ".lock"


class RunLock:
    """The lock of one model directory. `acquire()` raises `ConfigError` when another process holds it."""

    def __init__(self, model_dir: Path) -> None:
        self.path = Path(model_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another backend ({holder or 'holder unknown'}): two "
                "backends on one model directory would write the same checkpoints; close that backend "
                "(or stop its process), or register this model under another name or path"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ""
