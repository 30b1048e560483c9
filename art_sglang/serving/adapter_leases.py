"""Leases on served adapter names. A rollout holds its step's name for as long as it runs
(`InferenceService.lease`), and no command unloads a held name. An unload asked for while the name is
held is remembered, and runs when the last lease on the name ends, in a task of its own so the rollout
does not wait for it. Without that, an adapter that pipelined training pruned while a rollout held it
stayed loaded until some later prune, and after a run's last step until the server stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

logger = logging.getLogger(__name__)


class AdapterLeases:
    """How many leases hold each name, and the unloads that wait for a name's leases to end (`unload`
    unloads a name that is no longer held)."""

    def __init__(self, unload: Callable[[str], Awaitable[None]]) -> None:
        self._unload = unload
        self._held: Counter[str] = Counter()
        self._unload_when_free: set[str] = set()
        self._unloads: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lease(self, name: str, load: Callable[[], Awaitable[None]] | None) -> AsyncIterator[None]:
        """Hold `name` for the block, after `load()` (if given) made sure it is served."""
        self._held[name] += 1
        try:
            if load is not None:
                await load()
            yield
        finally:
            self._held[name] -= 1
            if self._held[name] <= 0:
                del self._held[name]
                if name in self._unload_when_free:
                    self._unload_when_free.discard(name)
                    task = asyncio.get_running_loop().create_task(self._unload_now(name))
                    self._unloads.add(task)
                    task.add_done_callback(self._unloads.discard)

    async def _unload_now(self, name: str) -> None:
        try:
            await self._unload(name)
        except Exception as exc:  # the next prune or the server's restart deals with it
            logger.warning("unloading %s after its last lease ended failed: %s", name, exc)

    def held(self, name: str) -> bool:
        return self._held.get(name, 0) > 0

    def names(self) -> frozenset[str]:
        return frozenset(self._held)

    def unload_when_free(self, name: str) -> None:
        """Unload `name` once its last lease ends (it is held now)."""
        self._unload_when_free.add(name)

    def wanted(self, name: str) -> None:
        """`name` was asked to be served again: an unload waiting for its leases is called off."""
        self._unload_when_free.discard(name)

    async def close(self) -> None:
        """Cancel the unloads still running (the servers are stopping) and wait for them to end."""
        for task in self._unloads:
            task.cancel()
        await asyncio.gather(*self._unloads, return_exceptions=True)
