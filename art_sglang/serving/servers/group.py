"""`ServerGroup`: the inference servers of a backend as one — one process, or several replicas behind
SGLang's router (`ReplicaRouter`); with a cluster in the plan, replicas on the nodes of a Ray cluster
(handed in by its `placement`, `cluster.ray_cluster`: the same `ServerHandle`), always with the router.

It owns the keys, the processes, their admin clients, the router, starting, stopping, crash recovery
(replicas restarted in the background with a growing pause while the others serve), GPU memory release
and resume, and the settings each replica starts with. It does not decide what a server holds: it tells
its `GroupHooks` (the adapter table) when a server came up, when routing changed and when requests must
wait, and routes to a server only after `server_started` returned and `ready_to_route` allows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

from ...config import ClusterConfig
from ...errors import ServerCrashedError
from ...planning.serving_plan import ServingPlan
from ...process_tree import EXIT_GRACE_SECONDS, gather_all
from ..sglang_api import MEMORY_TAGS, WEIGHTS_TAG
from .client import ServerClient
from .process import ServerProcess
from .replica import RemotePlacement, Replica, Server, ServerHandle, replica_log
from .replica_health import ReplicaRouter

logger = logging.getLogger(__name__)

# A server being replaced because it died or hangs gets this long to exit on SIGTERM before SIGKILL.
_HUNG_GRACE_S = 5.0


class GroupHooks(Protocol):
    """What the server group tells the side that decides what every server holds."""

    async def server_started(self, server: Server) -> None:
        """A fresh server process answers: give it everything it must hold. It is routed to only after."""
        ...

    async def weights_resumed(self, server: Server) -> bool:
        """A server took back its released weights: load its adapters again; False if it must be
        restarted instead (it holds an adapter SGLang cannot unload)."""
        ...

    def ready_to_route(self, server: Server) -> bool:
        """Whether a brought-up server may be routed now; False: it waits, up and unrouted, until a later
        `route_waiting` (or a restart of the others) finds it ready."""
        ...

    def routing_changed(self) -> None:
        """The routed servers (or the address requests go to) changed; after a start, requests may come."""
        ...

    def holding(self, *, drain: bool) -> AbstractAsyncContextManager[None]:
        """New requests wait for the block (with `drain`, once the ones in flight finished)."""
        ...


class ServerGroup:
    """The server process(es) of `plan`, their admin clients and the router. `own_key`: the servers get a
    key of their own (the gateway's upstream key) instead of `config.api_key`; `env`: added to their
    environment. Commands that change the servers run one at a time (`command()`)."""

    def __init__(
        self,
        plan: ServingPlan,
        base_model: str,
        *,
        log_path: Path,
        own_key: bool,
        hooks: GroupHooks,
        env: Mapping[str, str] | None = None,
        placement: Callable[[ClusterConfig], RemotePlacement] | None = None,
    ):
        config = plan.server_config
        engine = plan.layout.engine
        self._config = config
        self._hooks = hooks
        # The servers' keys are their own: rollout clients hold `config.api_key`, which opens the gateway;
        # the gateway alone holds the key of a server's ordinary routes, and this group alone the admin
        # key. Without the gateway clients talk to the server with their key, and behind SGLang's router
        # too (the router reaches the replicas with what clients send).
        # Hex keys: one starting with "-" would read as a flag where a config file becomes command-line flags.
        self._server_key = secrets.token_hex(32) if own_key else config.api_key
        self._own_key = own_key
        self._admin_key = secrets.token_hex(32)
        self._replicas = []
        self._cluster: RemotePlacement | None = None
        if plan.cluster is not None:
            if placement is None:
                raise ValueError("a plan with a cluster needs its replicas' placement (cluster.ray_cluster)")
            self._cluster = placement(plan.cluster)
        for n, planned in enumerate(plan.replicas):
            configs = tuple(c.model_copy(update={"api_key": self._server_key}) for c in planned.configs)
            if self._cluster is not None:
                remote = self._cluster.server(
                    configs[0], base_model, engine=engine, admin_api_key=self._admin_key,
                    env=env, label=f"{engine} server replica {n} (Ray)",
                )  # fmt: skip
                self._replicas.append(Replica(remote, planned.gpu_ids, configs, files=remote))
                continue
            process = ServerProcess(
                configs[0],
                base_model,
                engine=engine,
                log_path=replica_log(log_path, n),
                gpu_ids=list(planned.gpu_ids),
                admin_api_key=self._admin_key,
                env=env,
            )
            if plan.routed:
                process.label = f"{engine} server replica {n}"
            self._replicas.append(Replica(process, planned.gpu_ids, configs))
        self._router: ReplicaRouter | None = None
        if plan.routed:
            python = config.resolved_server_python() if engine == "sglang" else sys.executable
            self._router = ReplicaRouter(
                python=python,
                policy=config.router_policy,
                log_path=log_path.with_name(f"{log_path.stem}-router{log_path.suffix}"),
                startup_timeout=config.server_timeout,
            )
        # Whether the servers are meant to serve now: False before the first start, while the trainer has
        # the GPU (shared mode) and after close(). Crash recovery restarts only a server meant to serve.
        self._serving = False
        self._released_tags: tuple[str, ...] = ()  # GPU memory kinds released for the trainer
        self._lock = asyncio.Lock()  # one command at a time changes the servers
        # Replicas being restarted while the others serve (see `_restart_beside`).
        self._restarts: dict[Replica, asyncio.Task[None]] = {}
        # Held by the watchdog while its health probes are in flight: SGLang 0.5.17 answers GET /health
        # by generating a token, and a memory release that meets a running request kills its scheduler.
        self._probing = asyncio.Lock()

    # --- what others may read ----------------------------------------------------------------------------
    @property
    def processes(self) -> tuple[ServerHandle, ...]:
        """Every server replica's process, in the order of their GPUs."""
        return tuple(replica.process for replica in self._replicas)

    @property
    def router(self) -> ReplicaRouter | None:
        """SGLang's router in front of the replicas; None with one server."""
        return self._router

    @property
    def server_key(self) -> str | None:
        """The key of the servers' ordinary routes."""
        return self._server_key

    @property
    def serving(self) -> bool:
        """Whether the servers are meant to serve now (started and not handed to the trainer)."""
        return self._serving

    @property
    def upstream(self) -> str:
        """Where clients without the gateway send requests: the router, or the one server."""
        return self._router.base_url if self._router is not None else self._replicas[0].process.base_url

    @property
    def health_url(self) -> str | None:
        """The router whose health checks say which routed replicas fail (None without a router, or
        while it is down)."""
        return self._router.base_url if self._router is not None and self._router.is_alive() else None

    def up(self) -> list[Server]:
        """The servers that are up (running and brought up)."""
        return [replica.view() for replica in self._replicas if replica.up]

    def routed(self) -> list[Server]:
        """The servers routed to (one that died stays until recovery takes it out)."""
        return [replica.view() for replica in self._replicas if replica.routed_url is not None]

    def routed_urls(self) -> list[str]:
        return [server.routed_url for server in self.routed() if server.routed_url is not None]

    def live(self) -> list[ServerClient]:
        """Admin clients of the servers that are up; `ServerCrashedError` if none is."""
        clients = [server.client for server in self.up()]
        if not clients:
            raise ServerCrashedError("the inference server is not running: start it first")
        return clients

    @contextlib.asynccontextmanager
    async def command(self) -> AsyncIterator[None]:
        """One command at a time changes the servers (and what they hold)."""
        async with self._lock:
            yield

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> bool:
        """Make the servers serve: start those not running, each brought up before a request reaches it.
        Returns whether a server process was started."""
        async with self._lock:
            return await self.bring_up()

    async def stop(self) -> None:
        """Stop the servers on purpose (shared mode "restart"): crash recovery leaves them down until they
        are brought up again."""
        async with self._lock:
            self._serving = False
            await self._stop_replicas(self._replicas)

    async def restart_all(self) -> None:
        """Stop every server and bring them up again. Call inside `command()` with requests held."""
        await self._stop_replicas(self._replicas)
        await self.bring_up()

    async def recover(self, *, probe: bool = True) -> bool:
        """Restart every server (and the router) that should serve but died, or has not answered
        `GET /health` for `unresponsive_timeout` seconds (hung or stopped), brought up again before a
        request reaches it. With replicas, a failed one is taken out of the router and restarted in the
        background while the others serve: this returns once it is out, so neither the watchdog nor a
        training step waits minutes for an SGLang start (one whose restart failed waits out its pause).
        Returns whether it restarted (or began restarting) anything. Does nothing while another command
        runs. `probe=False` only looks for dead processes: the step path uses it, since SGLang 0.5.17's
        /health takes a second (a one-token generation polled once a second); the watchdog probes."""
        if not self._serving or self._lock.locked():
            return False
        problems = {}
        async with self._probing:
            if not self._serving:
                return False
            for replica in self._replicas:
                if replica in self._restarts or time.monotonic() < replica.restart_after:
                    continue
                problem = await replica.problem(probe=probe, timeout=self._config.unresponsive_timeout)
                if problem is not None:
                    problems[replica] = problem
        router_died = self._router is not None and not self._router.is_alive()
        if not problems and not router_died:
            return False
        async with self._lock:
            if not self._serving:
                return False
            for replica, problem in problems.items():
                logger.warning(
                    "the %s %s; restarting it. Last lines of its log:\n%s",
                    replica.process.label,
                    problem,
                    replica.process.log_tail(),
                )
            if router_died and self._router is not None:
                logger.warning("SGLang's router died; restarting it. Last lines of its log:\n%s",
                               self._router.log_tail())  # fmt: skip
            survivors = [r for r in self._replicas if r not in problems and r.routed_url is not None]
            # Requests in flight on a failed server are lost with it; none is waited for. Requests wait in
            # the gateway only when no server is left to answer them.
            if survivors and not router_died:
                await self._stop_replicas(list(problems), timeout=_HUNG_GRACE_S)
                for replica in problems:
                    self._restarts[replica] = asyncio.get_running_loop().create_task(
                        self._restart_beside(replica), name=f"restart {replica.process.label}"
                    )
                return True
            hold = (
                self._hooks.holding(drain=False) if router_died or not survivors else contextlib.nullcontext()
            )
            async with hold:
                await self._stop_replicas(list(problems), timeout=_HUNG_GRACE_S)
                await self.bring_up()
            return True

    async def _restart_beside(self, replica: Replica) -> None:
        """Start a failed replica while the others serve (without the lock: adapter commands and training
        steps go on, skipping it since it is not up), then, under the lock, bring it up and route to it. A
        failed start is logged and the process stopped: the watchdog's next look finds it dead and tries
        again once its pause is over."""
        began = time.monotonic()
        try:
            if replica.client is not None:
                await replica.client.aclose()
                replica.client = None
            await self._start_processes([replica])
            async with self._lock:
                if not self._serving or not replica.process.is_alive():
                    return
                await self._load_everything(replica)
                await self._put_in(replica)  # unless it waits: `ready_to_route`
                self._hooks.routing_changed()
            replica.failed_restarts = 0
            logger.info(
                "%s back at %s (%.1f s)",
                replica.process.label,
                replica.process.base_url,
                time.monotonic() - began,
            )
        except Exception:
            pause = replica.restart_failed()
            logger.exception(
                "restarting the %s failed (%d in a row); the others serve, next try in %.0f s",
                replica.process.label,
                replica.failed_restarts,
                pause,
            )
            await replica.process.stop(timeout=_HUNG_GRACE_S)
        finally:
            self._restarts.pop(replica, None)

    async def _cancel_restarts(self, replicas: Sequence[Replica]) -> None:
        """Stop the background restarts of `replicas` (their processes are stopped by the caller)."""
        tasks = [self._restarts[r] for r in replicas if r in self._restarts]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop the servers, the router and the clients. Idempotent. Servers get the short grace period: at
        close nothing on them is worth waiting for, and SGLang's scheduler sleeps 5 s on SIGTERM."""
        self._serving = False
        await self._cancel_restarts(self._replicas)
        stops = [replica.process.stop(timeout=EXIT_GRACE_SECONDS) for replica in self._replicas]
        if self._router is not None:
            stops.append(self._router.stop())
        await gather_all(*stops)
        for replica in self._replicas:
            replica.routed_url = None
            if replica.client is not None:
                await replica.client.aclose()
                replica.client = None
        if self._cluster is not None:
            await self._cluster.close()

    async def _stop_replicas(self, replicas: Sequence[Replica], timeout: float = 20.0) -> None:
        """Take servers out of the router, then stop them (a background restart of one is called off)."""
        await self._cancel_restarts(replicas)
        for replica in replicas:
            await self._take_out(replica)
        await gather_all(*(replica.process.stop(timeout=timeout) for replica in replicas))

    async def bring_up(self) -> bool:
        """Start every server (and the router) not running and bring it up (`GroupHooks.server_started`)
        before it is routed to. New requests wait meanwhile unless another server serves them. Call inside
        `command()`. Returns whether a server process was started."""
        down = [replica for replica in self._replicas if not replica.up and replica not in self._restarts]
        router_down = self._router is not None and not self._router.is_alive()
        if not down and not router_down:
            return False
        serving = [r for r in self._replicas if r not in down and r.routed_url is not None]
        # Nothing to drain: the callers that stop a serving server drained it first.
        hold = self._hooks.holding(drain=False) if router_down or not serving else contextlib.nullcontext()
        async with hold:
            began = time.monotonic()
            for replica in down:
                await self._take_out(replica)
            await self._start_processes(down)
            if self._router is not None and router_down:
                await self._router.start()
                for replica in self._replicas:
                    replica.routed_url = None  # a new router routes to nothing yet
            for replica in down:
                await self._load_everything(replica)
            await self.route_waiting()
            self._serving = True
            logger.info(
                "%s ready at %s (%.1f s)",
                ", ".join(r.process.label for r in down) or "SGLang's router",
                ", ".join(r.process.base_url for r in down) or self.upstream,
                time.monotonic() - began,
            )
        return bool(down)

    async def _start_processes(self, replicas: Sequence[Replica]) -> None:
        """Start server processes: on different GPUs at the same time; replicas sharing a GPU one after the
        other (a server measures the GPU's free memory when it starts and sizes its own from it, so one
        starting alongside another could count memory the other is about to take), each asking for its
        share of the GPU's memory."""
        groups: dict[tuple[str, ...], list[Replica]] = {}
        for n, replica in enumerate(replicas):
            # Without GPUs (the reference engine) nothing is shared; each starts on its own.
            groups.setdefault(replica.gpus or (f"cpu{n}",), []).append(replica)

        async def start_in_turn(group: list[Replica]) -> None:
            for replica in group:
                beside = [r for r in self._replicas if r is not replica and r.gpus and r.gpus == replica.gpus]
                replica.process.config = replica.configs[sum(r.process.is_alive() for r in beside)]
                await replica.process.start()

        await gather_all(*(start_in_turn(group) for group in groups.values()))

    async def _load_everything(self, replica: Replica) -> None:
        """Give a freshly started server its admin client, then let the hooks load what it must hold."""
        if replica.client is not None:
            await replica.client.aclose()
        replica.client = ServerClient(
            replica.process.base_url,
            api_key=replica.process.config.api_key,
            admin_api_key=self._admin_key,
            adapter_timeout=self._config.unresponsive_timeout,
        )
        await self._hooks.server_started(replica.view())

    async def route_waiting(self) -> None:
        """Route the brought-up servers not routed yet that `ready_to_route` allows (in `command()`)."""
        for replica in self._replicas:
            if replica.routed_url is None:
                await self._put_in(replica)
        self._hooks.routing_changed()

    async def _put_in(self, replica: Replica) -> None:
        """Route requests to a brought-up server, if the hooks let it."""
        if not replica.up or not self._hooks.ready_to_route(replica.view()):
            return
        url = replica.process.base_url
        if self._router is not None:
            # Replicas with a key of their own (behind the gateway; on other nodes, which listen on the
            # network): the router sends it in its health checks and in what it forwards.
            await self._router.add_worker(url, api_key=self._server_key if self._own_key else None)
        replica.routed_url = url

    async def _take_out(self, replica: Replica) -> None:
        """Stop routing requests to a server (the router forgets it before it stops or restarts)."""
        url, replica.routed_url = replica.routed_url, None
        if url is None:
            return
        self._hooks.routing_changed()
        if self._router is not None:
            await self._router.remove_worker(url)

    async def flush_cache(self) -> None:
        async with self._lock:
            for client in self.live():
                await client.flush_cache()

    # --- shared mode: GPU memory ---------------------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the servers' GPU memory of the kinds in `tags` (None = all) for the trainer (hold requests
        first); the processes stay."""
        async with self._lock:
            self._serving = False  # no new watchdog probe from here on; one in flight is waited for
            async with self._probing:
                await gather_all(*(server.client.release_memory_occupation(tags) for server in self.up()))
            self._released_tags = tuple(tags) if tags is not None else MEMORY_TAGS

    async def resume_memory(self) -> bool:
        """Take back what `release_memory` freed; when the weights were released, the hooks load the
        adapters again (`weights_resumed`). A server that died meanwhile is started instead. Returns whether
        a server process was started."""
        async with self._lock:
            tags, self._released_tags = self._released_tags, ()
            async with self._hooks.holding(drain=True):
                for replica in [r for r in self._replicas if r.up]:
                    server = replica.view()
                    if tags:
                        await server.client.resume_memory_occupation(list(tags))
                    if WEIGHTS_TAG in tags and not await self._hooks.weights_resumed(server):
                        await self._stop_replicas([replica])  # brought up again below
                started = await self.bring_up()
                self._serving = True
            return started
