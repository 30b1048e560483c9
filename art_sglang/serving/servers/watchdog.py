"""The watchdog of the inference server: it restarts a server that died or stopped answering, at any time
(during train() too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .group import ServerGroup

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
WATCHDOG_MAX_PAUSE_S = 60.0


class ServerWatchdog:
    """A task in the caller's event loop that calls `ServerGroup.recover` every second."""

    def __init__(self, servers: ServerGroup) -> None:
        self._servers = servers
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def ensure_running(self) -> None:
        """Run the watchdog in the current event loop (again, if an earlier loop ended)."""
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="art-sglang-watchdog")

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task

    async def _watch(self) -> None:
        """Restart a server that died, with every adapter loaded again before it serves: new requests wait
        in the gateway meanwhile. Failed restarts are retried with a growing pause and raised to the user
        by the next train() or register()."""
        pause = WATCHDOG_INTERVAL_S
        while not self._stopped:
            await asyncio.sleep(pause)
            try:
                await self._servers.recover()
                pause = WATCHDOG_INTERVAL_S
            except Exception:
                logger.exception("restarting the inference server failed")
                pause = min(pause * 2, WATCHDOG_MAX_PAUSE_S)
