"""Weights pushed into running servers from another process's memory (merged-weight rollouts,
docs/merged-rollouts.md), as SGLang 0.5.17 allows it: generation paused (`abort`: the scheduler is idle, so
the update's cache flush works), the buckets loaded, the cache flush and the weight version with the last
bucket only (a push cut short leaves the previous version reported), the version read back from each
server, generation continued. Nothing rolls a partial push back: a server whose push failed holds a mix and
stays paused until a whole push succeeds or it restarts.

Two transports: `/update_weights_from_tensor` (CUDA IPC handles, shared memory on CPU: the source shares the
server's device), or a weight-update group (`UpdateGroup`: NCCL, gloo on CPU), where the source broadcasts
each bucket while every server receives it by `/update_weights_from_distributed`."""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from ...errors import ServerRequestError, TrainerError
from ...process_tree import gather_all
from .client import ServerClient
from .process import claim_port, release_port
from .replica import Server

logger = logging.getLogger(__name__)

# One bucket for every server: (bucket, last) -> True to go on. The bucket as the source describes it:
# `payload` (update_weights_from_tensor's serialized tensors) or `names`, `dtypes`, `shapes` (a broadcast's).
BucketSink = Callable[[dict[str, Any], bool], Awaitable[bool]]
PUSH_ATTEMPTS = 2
# How long a group's members wait for each other (joining, each broadcast): a member that never comes (its
# request was lost) fails the push after this long instead of hanging it.
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the members of a weight-update group meet (the source is rank 0, weight_group.py)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str  # "nccl", or "gloo" on CPU
    timeout_s: float = GROUP_TIMEOUT_S


class WeightsSource(Protocol):
    """Where pushed weights come from (the trainer): the name they are served under, and the push."""

    load_format: str | None  # how a tensor bucket's payload is serialized (a broadcast's is always flattened)

    async def version(self) -> str:
        """The served name of the weights the next `push` hands over."""
        ...

    async def push(self, sink: BucketSink, group_name: str | None) -> None:
        """Hand every bucket to `sink`, in order; raises if the weights handed over are not `version`'s.
        With `group_name`, each bucket is broadcast over that group while `sink` runs."""
        ...

    async def join_group(self, address: GroupAddress) -> None:
        """Join the group at `address` as rank 0 (leaving any other); returns once every rank joined."""
        ...

    def in_group(self, group_name: str) -> bool:
        """Whether the source is still the rank 0 of `group_name` (it did not restart since it joined)."""
        ...


class UpdateGroup:
    """The weight-update group of a source (rank 0) and the servers a push goes to (their tensor-parallel
    ranks after it, in order). Made at the first push, made again when the servers pushed to are others
    (one restarted: a fresh process has no group) or the source restarted, and after a failed push (a
    broadcast that failed leaves the group in no known state). Each group gets a new name, so a server
    that kept an old one never meets it again. The group meets at this machine's address on the route to
    the first server (127.0.0.1 for servers of this machine; its network address for a Ray node's)."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._numbers = itertools.count(1)
        self._name: str | None = None
        self._members: list[Server] = []

    async def ready(self, servers: Sequence[Server], source: WeightsSource) -> str:
        """The group of `source` and exactly `servers`, made if need be; returns its name."""
        clients = [server.client for server in servers]
        if self._name is not None and source.in_group(self._name) and clients == self._clients():
            return self._name
        await self.dissolve()
        name = f"art_weights_{next(self._numbers)}"
        # Each server's first rank (the source is rank 0), and last the group's size.
        offsets = list(itertools.accumulate((server.ranks for server in servers), initial=1))
        here = address_towards(urlsplit(clients[0].base_url).hostname or "127.0.0.1")
        port = claim_port(here, None)
        self._name, self._members = name, list(servers)
        address = GroupAddress(here, port, offsets[-1], name, self._backend)
        try:
            await gather_all(
                source.join_group(address),
                *(
                    client.init_weights_update_group(
                        here, port, offset, address.world_size, name, self._backend
                    )
                    for client, offset in zip(clients, offsets[:-1], strict=True)
                ),
            )
        except BaseException:
            await self.dissolve()  # the members that joined leave again
            raise
        finally:
            release_port(port)
        logger.info("weight-update group %s: the source and %s", name, ", ".join(s.label for s in servers))
        return name

    async def dissolve(self) -> None:
        """Forget the group; the servers of it that still run the process that joined leave it."""
        name, self._name = self._name, None
        members, self._members = self._members, []
        for server in members:
            if name is not None and not server.client.closed:  # a restarted server's client is closed
                try:
                    await server.client.destroy_weights_update_group(name)
                except ServerRequestError as exc:
                    logger.warning("the %s did not leave weight-update group %s: %s", server.label, name, exc)

    def _clients(self) -> list[Any]:
        return [server.client for server in self._members]


def address_towards(host: str) -> str:
    """This machine's IPv4 address on the route to `host` (connecting a UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return str(sock.getsockname()[0])


class WeightPusher:
    """Pushes into a backend's servers: as tensors, or over an `UpdateGroup` of `group_backend` when given
    ("nccl", "gloo"; `ServingPlan.weight_update_group`)."""

    def __init__(self, group_backend: str | None) -> None:
        self._group = UpdateGroup(group_backend) if group_backend is not None else None
        self._versions: dict[ServerClient, str] = {}  # the version each reported after its last push

    def version_of(self, server: Server) -> str | None:
        """The version `server` reported after its last push; None if none reached it whole."""
        return self._versions.get(server.client)

    async def push(
        self, servers: Sequence[Server], source: WeightsSource, *, flush_cache: bool = True
    ) -> str:
        """Push `source`'s weights into `servers` at once; returns the version every one of them now
        reports. `flush_cache`: empty the prefix cache with the last bucket, so no request reuses keys and
        values the previous weights computed. `ServerRequestError` (or the source's `TrainerError`) if any
        failed: those servers stay paused, and the group is dissolved."""
        version = await source.version()
        clients = [server.client for server in servers]
        # Whatever they held is being overwritten; a restarted server's old client is closed.
        self._versions = {c: v for c, v in self._versions.items() if c not in clients and not c.closed}
        group = self._group
        group_name = await group.ready(servers, source) if group is not None else None
        await gather_all(*(client.pause_generation("abort") for client in clients))

        async def sink(bucket: dict[str, Any], last: bool) -> bool:
            announced = version if last else None
            if group_name is not None:
                posts = [
                    client.update_weights_from_distributed(
                        bucket,
                        group_name=group_name,
                        flush_cache=last and flush_cache,
                        weight_version=announced,
                    )
                    for client in clients
                ]
            else:
                posts = [
                    client.update_weights_from_tensor(
                        bucket["payload"],
                        load_format=source.load_format,
                        flush_cache=last and flush_cache,
                        weight_version=announced,
                    )
                    for client in clients
                ]
            await gather_all(*posts)
            return True

        try:
            await source.push(sink, group_name)
        except BaseException:
            if group is not None:
                await group.dissolve()
            raise
        for server in servers:
            reported = await server.client.weight_version()
            if reported != version:
                raise ServerRequestError(
                    f"the {server.label} reports weights {reported!r} after a push of {version!r}"
                )
        await gather_all(*(client.continue_generation() for client in clients))
        self._versions.update(dict.fromkeys(clients, version))
        return version

    async def push_or_none(
        self, servers: Sequence[Server], source: WeightsSource, *, flush_cache: bool = True
    ) -> str | None:
        """`push`, pushed whole again after a failure (`PUSH_ATTEMPTS` in all); None if every attempt
        failed (the servers then hold a mix and must restart)."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                return await self.push(servers, source, flush_cache=flush_cache)
            except (ServerRequestError, TrainerError) as exc:
                logger.warning("weight push %d of %d failed: %s", attempt, PUSH_ATTEMPTS, exc)
        return None
