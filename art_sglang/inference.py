"""`InferenceService`: the inference server(s) of a backend, kept in a known state.

It owns the server process — or several replicas of it behind SGLang's router (`ReplicaRouter`) — their
admin clients, the `AdapterGateway` in front, the adapters that must be loaded, the aliases served by the
base slot and the base weights the servers must hold. All of that is private; callers (the backend, the
weight-sync strategies, the GPU handoff) change it only through the commands below, and each command
keeps one invariant: **a name the gateway routes is loaded on every server a request can reach**. Names
are routed only after every running replica loaded them and stop being routed before they are unloaded.
Whenever a server (re)starts — first start, a weight-sync restart, the shared-mode restart, crash
recovery — it loads every wanted adapter (and the base weights) before it is routed to: with one server
the gateway holds new requests meanwhile; with replicas the router is told to leave the restarting one
out, and the others go on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from .config import SGLangConfig
from .errors import AdapterLoadError, ServerCrashedError, ServerRequestError
from .model_store import check_adapter
from .process_tree import EXIT_GRACE_SECONDS, gather_all
from .server.client import MEMORY_TAGS, WEIGHTS_TAG, ServerClient
from .server.gateway import ANY, AdapterGateway
from .server.process import ServerProcess
from .server.replica_router import ReplicaRouter

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0
PROBE_TOKENS = 4  # a few: an adapter that cannot serve may answer its first token and fail at the next
# A server being replaced because it died or hangs gets this long to exit on SIGTERM before SIGKILL.
_HUNG_GRACE_S = 5.0
# A replica whose restart failed is tried again after this pause, doubled per failure in a row up to the
# maximum (the others serve meanwhile; a start that fails for good, out of memory say, must not spin).
_REPLICA_RETRY_S = 5.0
_REPLICA_RETRY_MAX_S = 300.0


@dataclass(eq=False)
class _Replica:
    """One server process, its admin client once it was brought up, and where the router reaches it."""

    process: ServerProcess
    gpus: tuple[str, ...]
    client: ServerClient | None = None
    routed_url: str | None = None  # the URL requests reach it at; None while it is not routed to
    unanswered_since: float | None = None  # first failed health check in a row
    failed_restarts: int = 0  # background restarts that failed in a row
    restart_after: float = 0.0  # monotonic time before which no background restart is tried

    @property
    def up(self) -> bool:
        """Running and brought up (holds what it must hold)."""
        return self.client is not None and self.process.is_alive()


class InferenceService:
    """Server process(es) + admin clients + router + gateway + what every server must hold (adapters,
    base weights). `replica_gpu_ids`: one server replica per entry (its GPUs), behind SGLang's router when
    there are several; None: one server on `gpu_ids`."""

    def __init__(
        self,
        config: SGLangConfig,
        base_model: str,
        *,
        engine: Literal["sglang", "reference"],
        log_path: Path,
        gpu_ids: Sequence[int | str] | None,
        use_gateway: bool = True,
        drain_timeout: float = 600.0,
        replica_gpu_ids: Sequence[Sequence[int | str]] | None = None,
    ):
        self._config = config
        self._base_model = base_model
        self._engine = engine
        placements = [gpu_ids] if replica_gpu_ids is None else list(replica_gpu_ids)
        # The servers' keys are their own: rollout clients hold `config.api_key`, which opens the gateway;
        # the gateway alone holds the key of a server's ordinary routes, and this service alone the admin
        # key. Without the gateway clients talk to the server with their key, and behind SGLang's router
        # too (the router reaches the replicas with what clients send).
        # Hex keys: one starting with "-" would read as a flag where a config file becomes command-line flags.
        own_key = use_gateway and len(placements) == 1
        self._server_config = config.model_copy(
            update={"api_key": secrets.token_hex(32) if own_key else config.api_key}
        )
        self._admin_key = secrets.token_hex(32)
        self._replicas = [
            _Replica(
                ServerProcess(
                    self._server_config,
                    base_model,
                    engine=engine,
                    log_path=_numbered(log_path, n),
                    gpu_ids=gpus,
                    admin_api_key=self._admin_key,
                ),
                tuple(str(g) for g in gpus or ()),
            )
            for n, gpus in enumerate(placements)
        ]
        self._router: ReplicaRouter | None = None
        if len(self._replicas) > 1:
            for n, replica in enumerate(self._replicas):
                replica.process.label = f"{engine} server replica {n}"
            python = config.resolved_server_python() if engine == "sglang" else sys.executable
            self._router = ReplicaRouter(
                python=python,
                policy=config.router_policy,
                log_path=log_path.with_name(f"{log_path.stem}-router{log_path.suffix}"),
                startup_timeout=config.server_timeout,
            )
            logger.warning(
                "%d server replicas behind SGLang's router: the router re-encodes requests and drops "
                "`return_token_ids`, so completions carry no sampled token ids and the trainer tokenizes "
                "them from their logprobs and text (as for a server that returns no ids)",
                len(self._replicas),
            )
        self._gateway: AdapterGateway | None = None
        if use_gateway:
            # A request the dead server refuses waits for the restart (as long as a start may take).
            self._gateway = AdapterGateway(
                "http://127.0.0.1:0",
                api_key=config.api_key,
                upstream_key=self._server_config.api_key,
                unreachable_wait=config.server_timeout,
                share_window=config.share_prefill_window_ms / 1000,
                upstream_keep_alive=self._replicas[0].process.keep_alive,
            )
            self._gateway.set_prefill_sharing(config.share_prefill)
        self._find_checkpoint: Callable[[str], Path | None] | None = None
        self._drain_timeout = drain_timeout
        self._adapters: dict[str, Path] = {}  # loaded (and wanted after every start), oldest first
        self._leases: Counter[str] = Counter()  # names rollouts hold: never unloaded while held
        # No longer routed, still loaded (on every running server) until their requests finish.
        self._unloading: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # names served by the base slot (merged weights)
        self._base_ids: list[str] = []
        self._base_weights: Path | None = None  # merged weights the base slot holds; None = the original
        # Whether the server is meant to serve now: False before the first start, while the trainer has
        # the GPU (shared mode) and after close(). Crash recovery restarts only a server meant to serve.
        self._serving = False
        self._released_tags: tuple[str, ...] = ()  # GPU memory kinds released for the trainer
        self._holds = 0  # nested holds of the gateway; requests wait while > 0
        self._lock = asyncio.Lock()  # one command at a time changes the server
        # Replicas being restarted while the others serve (see `_restart_beside`).
        self._restarts: dict[_Replica, asyncio.Task[None]] = {}
        # Held by the watchdog while its health probes are in flight: SGLang 0.5.17 answers GET /health
        # by generating a token, and a memory release that meets a running request kills its scheduler.
        self._probing = asyncio.Lock()

    # --- what others may read ----------------------------------------------------------------------------
    @property
    def base_model(self) -> str:
        return self._base_model

    @property
    def process(self) -> ServerProcess:
        """The (first) server process (read its pid, address, liveness and `config.api_key`, the key of its
        ordinary routes; start and stop it through the service)."""
        return self._replicas[0].process

    @property
    def processes(self) -> tuple[ServerProcess, ...]:
        """Every server replica's process, in the order of their GPUs."""
        return tuple(replica.process for replica in self._replicas)

    @property
    def router(self) -> ReplicaRouter | None:
        """SGLang's router in front of the replicas; None with one server."""
        return self._router

    @property
    def gateway(self) -> AdapterGateway | None:
        return self._gateway

    @property
    def serving(self) -> bool:
        """Whether the server is meant to serve now (started and not handed to the trainer)."""
        return self._serving

    @property
    def openai_base_url(self) -> str:
        """What models' OpenAI clients use: the gateway when on, else the server itself (with /v1)."""
        root = self._gateway.base_url if self._gateway is not None else self._upstream()
        return f"{root}/v1"

    def _upstream(self) -> str:
        """Where requests go behind the gateway: the router, or the one server."""
        return self._router.base_url if self._router is not None else self._replicas[0].process.base_url

    @property
    def api_key(self) -> str:
        # The OpenAI client insists on a key; the server ignores it unless it was started with one.
        return self._config.api_key or "default"

    def client_name(self, name: str) -> str:
        """The `model` a client sends to be served `name`: the name itself through the gateway. Without
        the gateway, SGLang's own `<base>:<adapter>` form (a bare adapter name is answered by the base
        model) or, for an alias, the base id."""
        if self._gateway is not None:
            return name
        if name in self._aliases:
            return self._aliases[name]
        return f"{self._base_id()}:{name}"

    def _base_id(self) -> str:
        return self._base_ids[0] if self._base_ids else self._base_model

    def serve_on_demand(self, find_checkpoint: Callable[[str], Path | None]) -> None:
        """Load a name that is not served when a request asks for it, if `find_checkpoint(name)` finds its
        adapter on disk (older steps); other names stay 404. Call from the backend's event loop."""
        self._find_checkpoint = find_checkpoint
        if self._gateway is not None:
            self._gateway.set_loader(self._load_on_demand, asyncio.get_running_loop())

    async def _load_on_demand(self, name: str) -> bool:
        path = self._find_checkpoint(name) if self._find_checkpoint is not None else None
        if path is None or not self._serving:
            return False
        logger.info("loading %s on request (%s)", name, path)
        await self.add_adapter(name, path)
        return True

    # --- holding requests --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def holding(self, *, drain: bool = True) -> AsyncIterator[None]:
        """New requests wait in the gateway for the block; with `drain` it starts once the requests in
        flight finished. Holds nest: requests flow again when the outermost block ends."""
        self._holds += 1
        try:
            if self._gateway is not None:
                await self._gateway.hold()
                if drain and not await self._gateway.wait_idle(ANY, self._drain_timeout):
                    logger.warning("requests still in flight after %.0f s; going on", self._drain_timeout)
            yield
        finally:
            self._holds -= 1
            if self._holds == 0 and self._gateway is not None:
                await self._gateway.unhold()

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> bool:
        """Make the server serve: start it if it is not running, with every wanted adapter loaded before a
        request reaches it. Returns whether a server process was started."""
        async with self._lock:
            return await self._bring_up()

    async def restart(self) -> None:
        """Stop the server(s) and start again, requests held meanwhile."""
        async with self._lock, self.holding():
            await self._stop_replicas(self._replicas)
            await self._bring_up()

    async def stop(self) -> None:
        """Stop the server(s) on purpose (shared mode "restart"): crash recovery leaves them down until
        `start()`. Requests wait while the gateway is held, else fail with 502."""
        async with self._lock:
            self._serving = False
            await self._stop_replicas(self._replicas)

    async def recover(self, *, probe: bool = True) -> bool:
        """Restart every server (and the router) that should serve but died, or has not answered
        `GET /health` for `unresponsive_timeout` seconds (hung or stopped), with every adapter loaded again
        before a request reaches it. With replicas, a failed one is taken out of the router and restarted
        in the background while the others serve: this returns once it is out, so neither the watchdog nor
        a training step waits minutes for an SGLang start (one whose restart failed waits out its pause).
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
                problem = await self._problem(replica, probe=probe)
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
            hold = self.holding(drain=False) if router_died or not survivors else contextlib.nullcontext()
            async with hold:
                await self._stop_replicas(list(problems), timeout=_HUNG_GRACE_S)
                await self._bring_up()
            return True

    async def _restart_beside(self, replica: _Replica) -> None:
        """Start a failed replica while the others serve (without the lock: adapter commands and training
        steps go on, skipping it since it is not up), then, under the lock, load everything it must hold and
        route to it. A failed start is logged and the process stopped: the watchdog's next look finds it
        dead and tries again once its pause is over."""
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
                await self._put_in(replica)
                self._publish()
            replica.failed_restarts = 0
            logger.info(
                "%s back at %s (%.1f s); adapters: %s",
                replica.process.label,
                replica.process.base_url,
                time.monotonic() - began,
                ", ".join(self._adapters) or "none",
            )
        except Exception:
            replica.failed_restarts += 1
            pause = min(_REPLICA_RETRY_S * 2 ** (replica.failed_restarts - 1), _REPLICA_RETRY_MAX_S)
            replica.restart_after = time.monotonic() + pause
            logger.exception(
                "restarting the %s failed (%d in a row); the others serve, next try in %.0f s",
                replica.process.label,
                replica.failed_restarts,
                pause,
            )
            await replica.process.stop(timeout=_HUNG_GRACE_S)
        finally:
            self._restarts.pop(replica, None)

    async def _cancel_restarts(self, replicas: Sequence[_Replica]) -> None:
        """Stop the background restarts of `replicas` (their processes are stopped by the caller)."""
        tasks = [self._restarts[r] for r in replicas if r in self._restarts]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _problem(self, replica: _Replica, *, probe: bool) -> str | None:
        """What is wrong with a server: it died, or (with `probe`) it has not answered health checks long
        enough."""
        if not replica.process.is_alive():
            return "died"
        if not probe:
            return None
        timeout = self._config.unresponsive_timeout
        client = replica.client
        if client is not None and await client.health(timeout=min(timeout, 10.0)):
            replica.unanswered_since = None
            return None
        now = time.monotonic()
        if replica.unanswered_since is None:
            replica.unanswered_since = now
        if now - replica.unanswered_since < timeout:
            return None
        replica.unanswered_since = None
        return f"did not answer GET /health for {timeout:g} s"

    async def close(self) -> None:
        """Stop the server(s), the router, the gateway and the clients. Idempotent. Servers get the short
        grace period: at close nothing on them is worth waiting for, and SGLang's scheduler sleeps 5 s on
        SIGTERM."""
        self._serving = False
        await self._cancel_restarts(self._replicas)
        stops = [replica.process.stop(timeout=EXIT_GRACE_SECONDS) for replica in self._replicas]
        if self._router is not None:
            stops.append(self._router.stop())
        await gather_all(*stops)
        if self._gateway is not None:
            self._gateway.close()
        for replica in self._replicas:
            replica.routed_url = None
            if replica.client is not None:
                await replica.client.aclose()
                replica.client = None

    async def _stop_replicas(self, replicas: Sequence[_Replica], timeout: float = 20.0) -> None:
        """Take servers out of the router, then stop them (a background restart of one is called off)."""
        await self._cancel_restarts(replicas)
        for replica in replicas:
            await self._take_out(replica)
        await gather_all(*(replica.process.stop(timeout=timeout) for replica in replicas))

    async def _bring_up(self) -> bool:
        """Start every server (and the router) not running and load what it must hold before it is routed
        to (the one place that enforces the invariant after a start). New requests wait in the gateway
        meanwhile unless another server serves them. Call with the lock held. Returns whether a server
        process was started."""
        down = [replica for replica in self._replicas if not replica.up and replica not in self._restarts]
        router_down = self._router is not None and not self._router.is_alive()
        if not down and not router_down:
            return False
        serving = [r for r in self._replicas if r not in down and r.routed_url is not None]
        # Nothing to drain: the callers that stop a serving server drained it first.
        async with self.holding(drain=False) if router_down or not serving else contextlib.nullcontext():
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
            for replica in self._replicas:
                if replica.routed_url is None:
                    await self._put_in(replica)
            if self._gateway is not None:
                self._gateway.start()
            self._publish()
            self._serving = True
            logger.info(
                "%s ready at %s (%.1f s); adapters: %s",
                ", ".join(r.process.label for r in down) or "SGLang's router",
                ", ".join(r.process.base_url for r in down) or self._upstream(),
                time.monotonic() - began,
                ", ".join(self._adapters) or "none",
            )
        return bool(down)

    async def _start_processes(self, replicas: Sequence[_Replica]) -> None:
        """Start server processes: on different GPUs at the same time; replicas sharing a GPU one after the
        other (a server measures the GPU's free memory when it starts and sizes its own from it, so one
        starting alongside another could count memory the other is about to take), each asking for its
        share of the GPU's memory."""
        groups: dict[tuple[str, ...], list[_Replica]] = {}
        for n, replica in enumerate(replicas):
            # Without GPUs (the reference engine) nothing is shared; each starts on its own.
            groups.setdefault(replica.gpus or (f"cpu{n}",), []).append(replica)

        async def start_in_turn(group: list[_Replica]) -> None:
            for replica in group:
                replica.process.config = self._config_for(replica)
                await replica.process.start()

        await gather_all(*(start_in_turn(group) for group in groups.values()))

    def _config_for(self, replica: _Replica) -> SGLangConfig:
        """The server config of a replica about to start. SGLang sizes its memory as mem_fraction_static of
        the memory free when it starts: with k other replicas already running on its GPU, each holding the
        share f of it, f / (1 - k*f) of what they left is the same share f of the whole GPU."""
        if not replica.gpus:
            return self._server_config
        sharing = sum(
            1 for r in self._replicas if r is not replica and r.gpus == replica.gpus and r.process.is_alive()
        )
        fraction = self._server_config.mem_fraction_static
        if sharing == 0:
            return self._server_config
        return self._server_config.model_copy(
            update={"mem_fraction_static": round(fraction / (1 - sharing * fraction), 3)}
        )

    async def _load_everything(self, replica: _Replica) -> None:
        """Give a freshly started server its admin client, the base weights and every wanted adapter."""
        if replica.client is not None:
            await replica.client.aclose()
        replica.client = ServerClient(
            replica.process.base_url, api_key=replica.process.config.api_key, admin_api_key=self._admin_key
        )
        self._base_ids = [card.id for card in await replica.client.list_models() if card.parent is None]
        if self._base_weights is not None:
            # A fresh process holds the original base weights; the merged ones are applied again.
            await replica.client.update_weights_from_disk(str(self._base_weights))
        # A name being unloaded is still on the other servers, and may be routed again before it is gone.
        for name, path in {**self._unloading, **self._adapters}.items():
            await self._load_on_server(replica, name, path)

    async def _put_in(self, replica: _Replica) -> None:
        """Route requests to a brought-up server."""
        if not replica.up:
            return
        url = replica.process.base_url
        if self._router is not None:
            await self._router.add_worker(url)
        replica.routed_url = url

    async def _take_out(self, replica: _Replica) -> None:
        """Stop routing requests to a server (the router forgets it before it stops or restarts)."""
        url, replica.routed_url = replica.routed_url, None
        if url is None:
            return
        self._publish()
        if self._router is not None:
            await self._router.remove_worker(url)

    def _live(self) -> list[ServerClient]:
        """Admin clients of the servers that are up; `ServerCrashedError` if none is."""
        clients = [replica.client for replica in self._replicas if replica.up and replica.client is not None]
        if not clients:
            raise ServerCrashedError("the inference server is not running: start it first")
        return clients

    # --- shared mode: GPU memory ---------------------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the server's GPU memory of the kinds in `tags` (None = all) for the trainer (hold requests
        first); the process stays."""
        async with self._lock:
            self._serving = False  # no new watchdog probe from here on; one in flight is waited for
            async with self._probing:
                clients = [r.client for r in self._replicas if r.up and r.client is not None]
                await gather_all(*(client.release_memory_occupation(tags) for client in clients))
            self._released_tags = tuple(tags) if tags is not None else MEMORY_TAGS

    async def resume_memory(self) -> bool:
        """Take back what `release_memory` freed. When the weights were released, every adapter is loaded
        again (whether the LoRA pool survives that is SGLang's internal business, and reloading costs
        milliseconds); after a KV-cache-only release the adapters were never touched. A server that died
        meanwhile is started instead. Returns whether a server process was started."""
        async with self._lock:
            tags, self._released_tags = self._released_tags, ()
            async with self.holding():
                for replica in [r for r in self._replicas if r.up]:
                    assert replica.client is not None
                    if tags:
                        await replica.client.resume_memory_occupation(list(tags))
                    if WEIGHTS_TAG in tags:
                        for name, path in self._adapters.items():
                            with contextlib.suppress(ServerRequestError):  # already gone with the release
                                await replica.client.unload_lora_adapter(name)
                            await self._load_on_server(replica, name, path)
                started = await self._bring_up()
                self._serving = True
            return started

    # --- adapters --------------------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: Path) -> None:
        """Load `path` as `name` (checked locally first) on every running server, then route it. No-op if
        already loaded. A server that is down loads it when it is brought up, before it is routed to."""
        async with self._lock:
            if name in self._adapters:
                return
            if name not in self._unloading:  # else still on the servers: routing it again is enough
                check_adapter(path, self._config.max_lora_rank)
                await gather_all(*(self._load_on_server(r, name, path) for r in self._replicas if r.up))
            self._adapters[name] = path
            self._publish()

    async def remove_adapter(self, name: str) -> None:
        """Stop routing `name`, wait for its requests in flight, then unload it from the server. A leased
        name stays (see `lease`)."""
        async with self._lock:
            if self._leases[name] > 0 or name not in self._adapters:
                return
            self._unloading[name] = self._adapters.pop(name)
            self._publish()
        try:
            if not await self._wait_unused(name):
                logger.warning(
                    "requests on %s still in flight after %.0f s; unloading", name, self._drain_timeout
                )
            async with self._lock:
                if name in self._adapters:
                    return  # loaded again meanwhile
                for replica in self._replicas:
                    if replica.client is None or not replica.process.is_alive():
                        continue  # gone with the process
                    try:
                        await replica.client.unload_lora_adapter(name)
                    except ServerRequestError as exc:
                        logger.warning(
                            "unloading %s from the %s failed: %s", name, replica.process.label, exc
                        )
        finally:
            self._unloading.pop(name, None)

    async def _wait_unused(self, name: str) -> bool:
        """Wait until no request on `name` is in flight or `name` is routed again; False on timeout."""
        deadline = time.monotonic() + self._drain_timeout
        while self._gateway is not None and self._gateway.in_flight(name) > 0 and name not in self._adapters:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @contextlib.asynccontextmanager
    async def lease(self, name: str, path: Path) -> AsyncIterator[None]:
        """Keep `name` loaded and routed for the block (loading `path` first if it is not): the commands
        that unload adapters (`remove_adapter`, `keep_newest`, `prune`) leave a leased name alone, so a
        rollout finishes on the step it started with. Leases nest and may overlap."""
        self._leases[name] += 1
        try:
            await self.add_adapter(name, path)
            yield
        finally:
            self._leases[name] -= 1
            if self._leases[name] <= 0:
                del self._leases[name]

    def leased(self) -> frozenset[str]:
        """The names held by a lease now."""
        return frozenset(self._leases)

    async def keep_newest(self, prefix: str, keep: int) -> None:
        """Unload the adapters whose name starts with `prefix` except the `keep` newest (highest step) and
        the leased ones."""
        mine = sorted((name for name in self._adapters if name.startswith(prefix)), key=_step_of)
        for name in mine[: max(len(mine) - keep, 0)]:
            await self.remove_adapter(name)

    async def prune(self, prefix: str, retain: set[str]) -> None:
        """Unload the adapters whose name starts with `prefix` except `retain` and the leased ones."""
        for name in [name for name in self._adapters if name.startswith(prefix) and name not in retain]:
            await self.remove_adapter(name)

    async def replace_adapters(self, prefix: str, name: str, path: Path, *, restart: bool) -> None:
        """Make `name` the only adapter starting with `prefix`. With `restart`, by restarting the server
        with it preloaded (requests held; a restart ends every request in flight, so the older ones need
        not stay); else by loading it and then unloading the older ones."""
        if not restart:
            await self.add_adapter(name, path)
            await self.keep_newest(prefix, 1)
            return
        async with self._lock, self.holding():
            for old in [n for n in self._adapters if n.startswith(prefix)]:
                del self._adapters[old]
            self._adapters[name] = path
            check_adapter(path, self._config.max_lora_rank)
            await self._stop_replicas(self._replicas)
            await self._bring_up()

    async def _load_on_server(self, replica: _Replica, name: str, path: Path) -> None:
        assert replica.client is not None
        check_adapter(path, self._config.max_lora_rank)
        try:
            await replica.client.load_lora_adapter(name, str(path))
        except AdapterLoadError as exc:
            raise AdapterLoadError(
                f"the {replica.process.label} refused adapter {name!r} from {path}: {exc}",
                status=exc.status,
                server_message=exc.server_message,
            ) from exc

    # --- base weights (merged adapters) ------------------------------------------------------------------
    async def set_base_weights(self, path: Path | None) -> Path | None:
        """Make the base slot hold the weights at `path` (None: the original model's), requests held, and
        keep them across restarts. Returns the previous merged weights (None if the original)."""
        async with self._lock:
            previous = self._base_weights
            if path == previous:
                return previous
            async with self.holding():
                for client in self._live():
                    await client.update_weights_from_disk(str(path or self._base_model))
                    # The prefix cache holds keys/values computed with the old weights of the same slot.
                    await client.flush_cache()
            self._base_weights = path
            return previous

    def serve_alias(self, name: str, prefix: str) -> None:
        """Serve `name` with the base slot, replacing earlier aliases that start with `prefix`."""
        self._aliases = {k: v for k, v in self._aliases.items() if not k.startswith(prefix)}
        self._aliases[name] = self._base_id()
        self._publish()

    def _publish(self) -> None:
        if self._gateway is not None:
            self._gateway.set_served(self._adapters, self._base_ids, self._aliases)
            routed = [r.routed_url for r in self._replicas if r.routed_url is not None]
            self._gateway.set_upstream(self._upstream(), reads=routed[0] if routed else None)

    # --- checks ----------------------------------------------------------------------------------------
    async def probe(self, name: str) -> None:
        """A short greedy chat completion with logprobs (what rollouts ask) on `name` through the client
        path rollouts use and, with replicas, on each routed replica directly (the adapter selected as the
        gateway selects it); raises `ServerRequestError` unless each answers 200 with finite logprobs."""
        targets = [(self.openai_base_url, self.client_name(name), {}, self.api_key, "")]
        if self._router is not None:
            model = self._aliases.get(name, self._base_id())
            adapter = {} if name in self._aliases else {"lora_path": name}
            targets += [
                (f"{r.routed_url}/v1", model, adapter, r.process.config.api_key, f" on the {r.process.label}")
                for r in self._replicas
                if r.routed_url is not None
            ]
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as http:
            for url, model, adapter, key, where in targets:
                body = {"model": model, "messages": [{"role": "user", "content": "ping"}],
                        "max_tokens": PROBE_TOKENS, "temperature": 0.0, "logprobs": True, **adapter}  # fmt: skip
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                response = await http.post(f"{url}/chat/completions", json=body, headers=headers)
                if response.status_code != 200:
                    raise ServerRequestError(
                        f"probe request on {name!r}{where} failed with HTTP {response.status_code}: "
                        f"{response.text[:500]}",
                        status=response.status_code,
                        server_message=response.text,
                    )
                if not _finite_logprobs(response.json()):
                    raise ServerRequestError(
                        f"probe request on {name!r}{where} answered logprobs that are not finite numbers: "
                        f"{response.text[:500]}",
                        status=response.status_code,
                        server_message=response.text,
                    )

    async def flush_cache(self) -> None:
        async with self._lock:
            for client in self._live():
                await client.flush_cache()


def _finite_logprobs(completion: dict) -> bool:
    """Whether every token of a chat completion has a finite logprob (JSON has no NaN or infinity; a
    server writes them as literals, which Python reads, or as null)."""
    content = [
        t for choice in completion["choices"] for t in (choice.get("logprobs") or {}).get("content") or []
    ]
    return all(isinstance(t.get("logprob"), (int, float)) and math.isfinite(t["logprob"]) for t in content)


def _step_of(name: str) -> int:
    """The step of `<model>@<step>` (-1 for another form)."""
    step = name.rpartition("@")[2]
    return int(step) if step.isdigit() else -1


def _numbered(log_path: Path, n: int) -> Path:
    """Replica n's server log: the server log itself for the first, `server-replica<n>.log` for others."""
    return log_path if n == 0 else log_path.with_name(f"{log_path.stem}-replica{n}{log_path.suffix}")
