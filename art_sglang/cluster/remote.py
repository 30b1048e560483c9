"""The head's side of the replicas on a Ray cluster: `RayCluster` (the connection, the actors' placement
options, adapters' bytes put once into Ray's object store) and `RemoteServer`, one replica as the
`ServerGroup` sees a server process (start, stop, liveness, URL, log) plus its adapter files (`stage`:
ship the bytes, written on the node, checksum compared; `drop`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from ..config import ClusterConfig, SGLangConfig
from ..errors import AdapterLoadError, ServerStartError
from ..process_tree import EXIT_GRACE_SECONDS, LOG_TAIL_LINES
from ..serving.servers.process import Engine
from ..sglang_env import KEEP_ALIVE_ENV, SGLANG_ENV_DEFAULTS
from .files import adapter_version, checksum, read_adapter
from .host import ReplicaHost

logger = logging.getLogger(__name__)

# Adapters whose bytes stay in the object store for replicas that start later (a new step is shipped to
# every replica at once, so only the few steps rollouts still use are asked for again).
_PAYLOADS_KEPT = 8
# log_tail is synchronous (ServerHandle), read where a failure is reported: a node that does not answer
# must not hold the event loop long.
_LOG_TAIL_TIMEOUT_S = 2.0


class RayCluster:
    """The Ray cluster of `config`, joined on first use (a cluster this process did not join itself, as
    after the user's own `ray.init`, stays joined at close)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._joined_here = False
        self._payloads: OrderedDict[Any, tuple[ray.ObjectRef, str]] = OrderedDict()  # by adapter_version
        self._putting = asyncio.Lock()  # replicas ask for a new step at once; it is read and put once
        self._host_class: Any = None
        self._joining = asyncio.Lock()  # replicas start at the same time; one joins

    async def join(self) -> None:
        """Join the cluster, once; `ServerStartError` saying how to start one if none is found."""
        async with self._joining:
            if self._host_class is None:
                await self._join()

    async def _join(self) -> None:
        if not ray.is_initialized():
            try:
                await asyncio.to_thread(
                    ray.init, address=self.config.address, include_dashboard=False, log_to_driver=False
                )
            except ConnectionError as exc:
                raise ServerStartError(
                    f"found no Ray cluster at {self.config.address!r} ({exc}): start one with `ray start "
                    "--head` on this machine and `ray start --address=<head>:6379` on the others"
                ) from exc
            self._joined_here = True
        self._host_class = ray.remote(ReplicaHost)

    def new_host(self) -> Any:
        """A new replica actor, placed by Ray on a node with room (spread over the nodes)."""
        options = {
            "num_cpus": 0,
            "num_gpus": self.config.gpus_per_replica,
            "resources": dict(self.config.replica_resources),
            "max_restarts": 0,  # the head re-places a lost replica itself, adapters first
            "scheduling_strategy": "SPREAD",
        }
        return self._host_class.options(**options).remote(self.config.adapter_dir)

    def server(self, config: SGLangConfig, base_model: str, **options: Any) -> RemoteServer:
        """One replica on this cluster, placed on a node when it starts (`ServerGroup`'s `RemotePlacement`;
        `options`: `RemoteServer`'s)."""
        return RemoteServer(self, config, base_model, **options)

    def needs(self) -> str:
        """What one replica asks of a node, in words."""
        parts = {"GPU": self.config.gpus_per_replica, **self.config.replica_resources}
        return ", ".join(f"{value:g} {name}" for name, value in parts.items() if value)

    def nodes(self) -> str:
        """The cluster's live nodes and what they have free, in words (for errors)."""
        alive = [node for node in ray.nodes() if node.get("Alive")]
        return "; ".join(f"{n['NodeManagerAddress']} {n.get('Resources', {})}" for n in alive) or "none"

    async def payload(self, path: Path) -> tuple[ray.ObjectRef, str]:
        """The adapter at `path` in the object store (put once per write of its files) and its checksum."""
        async with self._putting:
            version = await asyncio.to_thread(adapter_version, path)
            if version not in self._payloads:
                files = await asyncio.to_thread(read_adapter, path)
                self._payloads[version] = (await asyncio.to_thread(ray.put, files), checksum(files))
                while len(self._payloads) > _PAYLOADS_KEPT:
                    self._payloads.popitem(last=False)
            self._payloads.move_to_end(version)
            return self._payloads[version]

    async def close(self) -> None:
        """Let go of the shipped bytes; leave a cluster this process joined itself."""
        self._payloads.clear()
        if self._joined_here and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
        self._joined_here = False
        self._host_class = None


async def _result(ref: ray.ObjectRef, timeout: float | None = None) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)


class RemoteServer:
    """One inference server replica as a Ray actor on some node (see the module docstring)."""

    def __init__(
        self,
        cluster: RayCluster,
        config: SGLangConfig,
        base_model: str,
        *,
        engine: Engine,
        admin_api_key: str,
        env: Mapping[str, str] | None,
        label: str,
    ) -> None:
        self.config = config
        self.label = label
        self._cluster = cluster
        self._base_model = base_model
        self._engine: Engine = engine
        self._admin_key = admin_api_key
        self._env = dict(env or {})
        self._actor: Any = None
        self._info: dict[str, Any] = {}
        self._exit: Any = None  # the pending `wait_exit` call's future: done once the server or node is gone
        self.staged: dict[str, str] = {}  # adapter name -> checksum the node reported for its files

    # --- what ServerGroup reads of a server process -------------------------------------------------
    @property
    def base_url(self) -> str:
        if "url" not in self._info:
            raise RuntimeError(f"the {self.label} has no address before it starts")
        return self._info["url"]

    @property
    def pid(self) -> int | None:
        """The server's process id on its node."""
        return self._info.get("pid")

    @property
    def node_id(self) -> str | None:
        return self._info.get("node_id")

    @property
    def log_path(self) -> Path:
        """The server's log, on its node."""
        return Path(self._info.get("log_path", f"<{self.label} not started>"))

    @property
    def adapter_dir(self) -> Path | None:
        """The node-local folder adapters are written into."""
        return Path(self._info["adapter_dir"]) if "adapter_dir" in self._info else None

    @property
    def keep_alive(self) -> float:
        """Seconds the server keeps an idle connection open (as `ServerProcess.keep_alive`)."""
        return float({**SGLANG_ENV_DEFAULTS, **self.config.server_env, **self._env}[KEEP_ALIVE_ENV])

    def is_alive(self) -> bool:
        return self._exit is not None and not self._exit.done()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        where = f"(its log is {self.log_path} on node {self._info.get('node_ip', '?')})"
        if self._actor is None:
            return where
        try:
            return ray.get(self._actor.log_tail.remote(lines), timeout=_LOG_TAIL_TIMEOUT_S)
        except RayError:
            return f"{where}: the node does not answer"

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Place an actor on a node with room (waiting up to `placement_timeout` for one), start the server
        there and wait until it is healthy; `ServerStartError` saying why not."""
        if self.is_alive():
            return
        await self.stop(timeout=EXIT_GRACE_SECONDS)
        self._info = {}  # the last start's address and node are no longer this replica's
        await self._cluster.join()
        self._actor = actor = self._cluster.new_host()
        wait = self._cluster.config.placement_timeout
        try:
            node = await _result(actor.ready.remote(), wait)
            logger.info("%s placed on Ray node %s", self.label, node)
            config = self.config.model_dump(exclude_unset=True)
            self._info = await _result(
                actor.start.remote(config, self._base_model, self._engine, self._admin_key, self._env)
            )
        except asyncio.CancelledError:
            # The caller gave up (close() during a background restart): no actor may stay behind.
            self._actor = None
            ray.kill(actor)
            raise
        except (TimeoutError, GetTimeoutError):
            await self.stop(timeout=EXIT_GRACE_SECONDS)
            raise ServerStartError(
                f"no node of the Ray cluster had room for the {self.label} within {wait:g} s (it needs "
                f"{self._cluster.needs() or 'nothing'}); live nodes: {self._cluster.nodes()}"
            ) from None
        except RayError as exc:
            await self.stop(timeout=EXIT_GRACE_SECONDS)
            cause = exc.cause if isinstance(exc, RayTaskError) else exc
            raise ServerStartError(f"the {self.label} did not start on its Ray node: {cause}") from None
        self._exit = actor.wait_exit.remote().future()

    async def stop(self, timeout: float = 20.0) -> None:
        """Stop the server and end its actor (a dead node's actor is only forgotten). Idempotent."""
        actor, self._actor = self._actor, None
        alive, self._exit = self.is_alive(), None
        self.staged.clear()
        if actor is None:
            return
        if alive:
            try:
                await _result(actor.stop.remote(timeout), timeout + EXIT_GRACE_SECONDS)
            except (TimeoutError, RayError) as exc:
                logger.warning("stopping the %s on its node failed (%s); ending its actor", self.label, exc)
        ray.kill(actor)
        # ray.kill only asks; a call fails once Ray has the actor dead, so close() returns after that.
        with contextlib.suppress(RayError, TimeoutError):
            await _result(actor.ready.remote(), EXIT_GRACE_SECONDS)

    # --- adapter files (AdapterFiles) --------------------------------------------------------------
    async def stage(self, name: str, path: Path) -> str:
        """Make the adapter at `path` (on this machine) loadable by the server as a path on its node:
        shipped through the object store and written there, unless every node shares the checkpoints."""
        if self._cluster.config.shared_filesystem:
            return str(path)
        if self._actor is None:
            raise AdapterLoadError(f"cannot ship adapter {name!r}: the {self.label} is not running")
        ref, expected = await self._cluster.payload(path)
        try:
            where, reported = await _result(self._actor.stage.remote(name, ref))
        except RayError as exc:
            raise AdapterLoadError(f"shipping adapter {name!r} to the {self.label} failed: {exc}") from None
        if reported != expected:
            raise AdapterLoadError(
                f"adapter {name!r} arrived on the {self.label} with checksum {reported}, not {expected}"
            )
        self.staged[name] = reported
        return where

    async def drop(self, name: str) -> None:
        """Delete the adapter's files on the node (the server unloaded it)."""
        self.staged.pop(name, None)
        if self._actor is not None and not self._cluster.config.shared_filesystem and self.is_alive():
            try:
                await _result(self._actor.drop.remote(name))
            except RayError as exc:
                logger.warning("deleting adapter %s on the %s failed: %s", name, self.label, exc)
