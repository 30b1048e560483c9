"""Weights pushed into running servers from another process's memory (merged-weight rollouts,
docs/merged-rollouts.md), as SGLang 0.5.17 allows it: generation paused (`abort`: the scheduler is idle, so
the update's cache flush works), the buckets loaded with `/update_weights_from_tensor`, the cache flush and
the weight version with the last bucket only (a push cut short leaves the previous version reported), the
version read back from each server, generation continued. Nothing rolls a partial push back: a server whose
push failed holds a mix and stays paused until a whole push succeeds or it restarts."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ...errors import ServerRequestError, TrainerError
from ...process_tree import gather_all
from .replica import Server

logger = logging.getLogger(__name__)

# One bucket for every server: (payload, last) -> True to go on.
BucketSink = Callable[[str, bool], Awaitable[bool]]
PUSH_ATTEMPTS = 2


class WeightsSource(Protocol):
    """Where pushed weights come from (the trainer): the name they are served under, and the push."""

    load_format: str | None

    async def version(self) -> str:
        """The served name of the weights the next `push` hands over."""
        ...

    async def push(self, sink: BucketSink) -> None:
        """Hand every bucket to `sink`, in order; raises if the weights handed over are not `version`'s."""
        ...


async def push_weights(servers: Sequence[Server], source: WeightsSource, *, flush_cache: bool = True) -> str:
    """Push `source`'s weights into `servers` at once; returns the version every one of them now reports.
    `flush_cache`: empty the prefix cache with the last bucket, so no request reuses keys and values the
    previous weights computed. `ServerRequestError` (or the source's `TrainerError`) if any failed: those
    servers stay paused."""
    version = await source.version()
    clients = [server.client for server in servers]
    await gather_all(*(client.pause_generation("abort") for client in clients))

    async def sink(payload: str, last: bool) -> bool:
        await gather_all(
            *(
                client.update_weights_from_tensor(
                    payload,
                    load_format=source.load_format,
                    flush_cache=last and flush_cache,
                    weight_version=version if last else None,
                )
                for client in clients
            )
        )
        return True

    await source.push(sink)
    for server in servers:
        reported = await server.client.weight_version()
        if reported != version:
            raise ServerRequestError(
                f"the {server.label} reports weights {reported!r} after a push of {version!r}"
            )
    await gather_all(*(client.continue_generation() for client in clients))
    return version


async def push_or_none(servers: Sequence[Server], source: WeightsSource, *, flush_cache: bool) -> str | None:
    """`push_weights`, pushed whole again after a failure (`PUSH_ATTEMPTS` in all); None if every attempt
    failed (the servers then hold a mix and must restart)."""
    for attempt in range(1, PUSH_ATTEMPTS + 1):
        try:
            return await push_weights(servers, source, flush_cache=flush_cache)
        except (ServerRequestError, TrainerError) as exc:
            logger.warning("weight push %d of %d failed: %s", attempt, PUSH_ATTEMPTS, exc)
    return None
