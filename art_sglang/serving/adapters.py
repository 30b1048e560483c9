"""`InferenceService`: what the inference servers of a backend hold and how clients reach it — the adapter
table (with leases and names being unloaded), aliases served by the base slot, the base weights, the
`AdapterGateway` in front and the publish probe. The servers themselves are its `ServerGroup`.

All of it is private; callers (the backend, the weight-sync strategies, the GPU handoff) change it through
the commands below, and the product rests on one rule, kept here and nowhere else: **a name the gateway
routes is loaded on every server a request can reach.** A name is routed only after every server that is
up loaded it (`add_adapter`), and stops being routed before it is unloaded (`remove_adapter`). A server
that (re)starts is given every wanted adapter and the base weights before the group routes to it
(`server_started`): with one server the gateway holds new requests meanwhile; with replicas the gateway
(and SGLang's router) leave the restarting one out while the others serve, and with pushed weights until
it holds the version they serve (`ready_to_route`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from ..config import ClusterConfig
from ..errors import AdapterLoadError, AdapterOperationTimeoutError, ServerCrashedError, ServerRequestError
from ..planning.serving_plan import SYNC_TRAITS, ServingPlan
from ..process_tree import gather_all
from ..storage.model_store import check_adapter
from .adapter_leases import AdapterLeases
from .gateway.app import ANY, AdapterGateway
from .gateway.resend import DRAINED
from .served_names import parse_served_name, served_name, step_of
from .servers.group import ServerGroup
from .servers.probe import ProbeTarget, probe_chat
from .servers.replica import RemotePlacement, Server, ServerHandle
from .servers.replica_health import ReplicaRouter
from .servers.weight_push import WeightPusher, WeightsSource

logger = logging.getLogger(__name__)


class InferenceService:
    """The adapter side of serving over the `ServerGroup` (`servers`) of `plan`: one server replica per
    planned replica, with SGLang's router checking their health when there are several. `env`: added to the servers'
    environment; `placement`: where a plan's replicas run on a cluster (`cluster.ray_cluster`)."""

    def __init__(
        self,
        plan: ServingPlan,
        base_model: str,
        *,
        log_path: Path,
        use_gateway: bool = True,
        env: Mapping[str, str] | None = None,
        drain_timeout: float = 600.0,
        placement: Callable[[ClusterConfig], RemotePlacement] | None = None,
    ):
        config = plan.server_config
        self._config = config
        self._base_model = base_model
        self._servers = ServerGroup(
            plan,
            base_model,
            log_path=log_path,
            # Behind the gateway the servers hold a key of their own; replicas on a cluster listen on the
            # network, so they are keyed always (the router sends them the key).
            own_key=use_gateway or plan.cluster is not None,
            hooks=self,
            env=env,
            placement=placement,
        )
        self._gateway: AdapterGateway | None = None
        if use_gateway:
            # A request the dead server refuses waits for the restart (as long as a start may take).
            self._gateway = AdapterGateway(
                None,
                api_key=config.api_key,
                upstream_key=self._servers.server_key,
                unreachable_wait=config.server_timeout,
                share_lead=config.share_prefill_lead_ms / 1000,
                upstream_keep_alive=self._servers.processes[0].keep_alive,
                tool_call_parser=config.tool_call_parser,
                replicated=plan.routed,
            )
            self._gateway.set_prefill_sharing(config.share_prefill)
        elif plan.routed:
            logger.warning(
                "%d server replicas behind SGLang's router without the gateway: the router re-encodes "
                "requests and drops `return_token_ids`, so completions carry no sampled token ids and the "
                "trainer tokenizes them from their logprobs and text (as for a server that returns no ids)",
                len(plan.replicas),
            )
        self._find_checkpoint: Callable[[str], Path | None] | None = None
        self._drain_timeout = drain_timeout
        self._adapters: dict[str, Path] = {}  # loaded (and wanted after every start), oldest first
        self._leases = AdapterLeases(self.remove_adapter)  # names rollouts hold (unloads wait for them)
        # No longer routed, still loaded (on every running server) until their requests finish.
        self._unloading: dict[str, Path] = {}
        # No longer routed, left loaded: SGLang can no longer unload them (stranded_adapters.py).
        self._stranded: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # names served by the base slot (merged weights)
        self._base_ids: list[str] = []
        self._base_weights: Path | None = None  # merged weights the base slot holds; None = the original
        self._pushed: tuple[WeightsSource, str] | None = None  # weights pushed into the base slot, prefix
        self._pusher = WeightPusher(plan.weight_update_group)
        self._holds = 0  # nested holds of the gateway; requests wait while > 0

    # --- what others may read ----------------------------------------------------------------------------
    @property
    def servers(self) -> ServerGroup:
        """The server process(es) and router: start, stop, recover, release and resume them there."""
        return self._servers

    @property
    def base_model(self) -> str:
        return self._base_model

    @property
    def process(self) -> ServerHandle:
        """The (first) server process (read its pid, address, liveness and `config.api_key`, the key of its
        ordinary routes)."""
        return self._servers.processes[0]

    @property
    def processes(self) -> tuple[ServerHandle, ...]:
        """Every server replica's process, in the order of their GPUs."""
        return self._servers.processes

    @property
    def router(self) -> ReplicaRouter | None:
        """SGLang's router in front of the replicas; None with one server."""
        return self._servers.router

    @property
    def gateway(self) -> AdapterGateway | None:
        return self._gateway

    @property
    def openai_base_url(self) -> str:
        """What models' OpenAI clients use: the gateway when on, else the servers themselves (with /v1)."""
        root = self._gateway.base_url if self._gateway is not None else self._servers.upstream
        return f"{root}/v1"

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
        if path is None or not self._servers.serving:
            return False
        logger.info("loading %s on request (%s)", name, path)
        await self.add_adapter(name, path)
        return True

    # --- what the server group tells (`GroupHooks`) ---------------------------------------------------------
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

    async def server_started(self, server: Server) -> None:
        """Give a fresh server the base weights and every wanted adapter."""
        self._base_ids = [card.id for card in await server.client.list_models() if card.parent is None]
        if self._base_weights is not None:
            # A fresh process holds the original base weights; the merged ones are applied again.
            await server.client.update_weights_from_disk(str(self._base_weights))
        if self._pushed is not None:  # likewise the pushed ones: the trainer's newest (`ready_to_route`)
            await self._pusher.push([server], self._pushed[0], flush_cache=self._flushes_pushes)
        if len(self._servers.processes) == 1:  # a fresh process: what was stranded went with the old one
            self._stranded.clear()
            if self._gateway is not None:
                self._gateway.stranded.clear()
        # A name being unloaded is still on the other servers, and may be routed again before it is gone.
        for name, path in {**self._unloading, **self._adapters}.items():
            await self._load_on_server(server, name, path)
        if self._adapters:  # a fresh backend has none yet: its first step's adapter comes next
            logger.info("%s loaded adapters %s", server.label, ", ".join(self._adapters))

    async def weights_resumed(self, server: Server) -> bool:
        """Load every adapter again after the weights came back (whether the LoRA pool survives a weights
        release is SGLang's internal business, and reloading costs milliseconds). False if a stranded adapter
        would have to be unloaded (known, or found by an unload that does not finish): the group then
        restarts the server."""
        if self._stranded or any(self._strands(name) for name in self._adapters):
            logger.warning("%s holds an adapter SGLang cannot unload: restarting it", server.label)
            return False
        for name, path in self._adapters.items():
            try:
                await server.client.unload_lora_adapter(name)
            except AdapterOperationTimeoutError as exc:  # in use by requests the gateway did not see
                logger.warning("%s: restarting it", exc)
                return False
            except ServerRequestError:
                pass  # already gone with the release
            await self._load_on_server(server, name, path)
        return True

    def ready_to_route(self, server: Server) -> bool:
        """Pushed weights: routed only holding the version the alias names, so no name is answered by another
        step's (one restarted before a step's push waits for it); if no other server holds it, it moves."""
        if self._pushed is None:
            return True
        prefix = self._pushed[1]
        served = max((name for name in self._aliases if name.startswith(prefix)), key=step_of, default=None)
        held = self._pusher.version_of(server)
        if held != served:
            if held is None or served in {self._pusher.version_of(s) for s in self._servers.up()}:
                return False
            self.serve_alias(held, prefix, older=self._config.max_steps_off_policy or 0)
        return True

    def routing_changed(self) -> None:
        """Tell the gateway (started if it is not) what is served and where."""
        if self._gateway is not None:
            self._gateway.start()
        self._publish()

    # --- adapters --------------------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: Path) -> None:
        """Load `path` as `name` (checked locally first) on every running server, then route it. No-op if
        already loaded. A server that is down loads it when it is brought up, before it is routed to."""
        async with self._servers.command():
            self._leases.wanted(name)
            if name in self._adapters:
                return
            if name in self._stranded:  # still on the servers that did not restart since
                self._stranded.pop(name)
                await gather_all(*(self._load_if_missing(s, name, path) for s in self._servers.up()))
            elif name not in self._unloading:  # else still on the servers: routing it again is enough
                check_adapter(path, self._config)
                await gather_all(*(self._load_on_server(s, name, path) for s in self._servers.up()))
            self._adapters[name] = path
            self._publish()

    async def remove_adapter(self, name: str) -> None:
        """Stop routing `name`, wait for its requests in flight, then unload it from the server. A leased
        name stays until its last lease ends, and is unloaded then (see `lease`)."""
        async with self._servers.command():
            if name not in self._adapters:
                return
            if self._leases.held(name):
                self._leases.unload_when_free(name)
                return
            self._unloading[name] = self._adapters.pop(name)
            self._publish()
        try:
            if not await self._wait_unused(name):
                logger.warning(
                    "requests on %s still in flight after %.0f s; unloading", name, self._drain_timeout
                )
            async with self._servers.command():
                if name in self._adapters:
                    return  # loaded again meanwhile
                if self._strands(name):
                    logger.warning(
                        "%s stays loaded on the server, unrouted: SGLang refused a request on it for its "
                        "length, and it then never lets the adapter go, so unloading it would block every "
                        "later adapter load (it goes when the server restarts)",
                        name,
                    )
                    self._stranded[name] = self._unloading[name]
                    return
                for server in self._servers.up():  # gone with the process from the others
                    try:
                        await server.client.unload_lora_adapter(name)
                        await server.files.drop(name)
                    except AdapterOperationTimeoutError as exc:
                        # Requests the gateway did not see still hold it: it stays, unrouted, until the
                        # server restarts (recovery restarts a server stuck in an adapter operation).
                        logger.warning("%s stays loaded on the %s, unrouted: %s", name, server.label, exc)
                        self._stranded[name] = self._unloading[name]
                    except ServerRequestError as exc:
                        logger.warning("unloading %s from the %s failed: %s", name, server.label, exc)
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

    def lease(self, name: str, path: Path) -> contextlib.AbstractAsyncContextManager[None]:
        """Keep `name` loaded and routed for the block (loading `path` first if it is not): the commands
        that unload adapters (`remove_adapter`, `keep_newest`, `prune`) unload a leased name only once its
        last lease ends, so a rollout finishes on the step it started with. Leases nest and may overlap."""
        older = SYNC_TRAITS[self._config.weight_sync_method].serves_older_steps  # else by alias (serve_alias)
        return self._leases.lease(name, (lambda: self.add_adapter(name, path)) if older else None)

    def leased(self) -> frozenset[str]:
        """The names held by a lease now."""
        return self._leases.names()

    async def keep_newest(self, prefix: str, keep: int) -> None:
        """Unload the adapters whose name starts with `prefix` except the `keep` newest (highest step); a
        leased one once its last lease ends."""
        mine = sorted((name for name in self._adapters if name.startswith(prefix)), key=step_of)
        for name in mine[: max(len(mine) - keep, 0)]:
            await self.remove_adapter(name)

    async def prune(self, prefix: str, retain: set[str]) -> None:
        """Unload the adapters whose name starts with `prefix` except `retain`; a leased one once its last
        lease ends."""
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
        async with self._servers.command(), self.holding():
            for old in [n for n in self._adapters if n.startswith(prefix)]:
                del self._adapters[old]
            self._adapters[name] = path
            check_adapter(path, self._config)
            await self._servers.restart_all()

    def _strands(self, name: str) -> bool:
        return self._gateway is not None and name in self._gateway.stranded

    async def _load_if_missing(self, server: Server, name: str, path: Path) -> None:
        if name not in {card.id for card in await server.client.list_models()}:
            await self._load_on_server(server, name, path)

    async def _load_on_server(self, server: Server, name: str, path: Path) -> None:
        check_adapter(path, self._config)
        try:
            await server.client.load_lora_adapter(name, await server.files.stage(name, path))
        except AdapterLoadError as exc:
            raise AdapterLoadError(
                f"the {server.label} refused adapter {name!r} from {path}: {exc}",
                status=exc.status,
                server_message=exc.server_message,
            ) from exc

    # --- base weights (merged adapters) ------------------------------------------------------------------
    async def set_base_weights(self, path: Path | None) -> Path | None:
        """Make the base slot hold the weights at `path` (None: the original model's), requests held, and
        keep them across restarts. Returns the previous merged weights (None if the original)."""
        async with self._servers.command():
            previous = self._base_weights
            if path == previous:
                return previous
            async with self.holding():
                for client in self._servers.live():
                    await client.update_weights_from_disk(str(path or self._base_model))
                    # The prefix cache holds keys/values computed with the old weights of the same slot.
                    await client.flush_cache()
            self._base_weights = path
            return previous

    async def push_weights(self, source: WeightsSource, prefix: str) -> None:
        """Serve `source`'s pushed weights by the base slot under the name they report, on every server and
        each that starts later; a failed push is retried whole, then the servers restart. New requests wait;
        those in flight are cut by the push and continued on the new weights by the gateway (resend.py),
        except the ones it cannot continue, which finish first."""
        async with self._servers.command(), self.holding(drain=False):
            if self._gateway is not None and not await self._gateway.wait_idle(DRAINED, self._drain_timeout):
                logger.warning("requests still in flight after %.0f s; going on", self._drain_timeout)
            self._pushed = (source, prefix)
            self._aliases = {k: v for k, v in self._aliases.items() if not k.startswith(prefix)}
            version = await self._pusher.push_or_none(
                self._servers.up(), source, flush_cache=self._flushes_pushes
            )
            if version is None:
                await self._servers.restart_all()  # `server_started` pushes and serves them
            else:
                self.serve_alias(version, prefix, older=self._config.max_steps_off_policy or 0)
                await self._servers.route_waiting()  # a server restarted before this push

    @property
    def _flushes_pushes(self) -> bool:
        return self._config.flush_cache_on_sync is not False  # None (the default) flushes pushed weights

    def serve_alias(self, name: str, prefix: str, older: int = 0) -> None:
        """Serve `name` with the base slot, replacing earlier aliases that start with `prefix`; and the
        names of the `older` steps before it (their rollouts get `name`'s weights; their choices say so)."""
        self._aliases = {k: v for k, v in self._aliases.items() if not k.startswith(prefix)}
        model, step = parse_served_name(name) or (name, 0)
        for older_step in range(max(step - older, 0), step):
            self._aliases[served_name(model, older_step)] = self._base_id()
        self._aliases[name] = self._base_id()
        self._publish()

    def _publish(self) -> None:
        if self._gateway is not None:
            self._gateway.set_served(self._adapters, self._base_ids, self._aliases)
            self._gateway.set_upstream(self._servers.routed_urls(), health=self._servers.health_url)

    # --- checks ----------------------------------------------------------------------------------------
    async def probe(self, name: str) -> None:
        """A short greedy chat completion with logprobs (what rollouts ask) on `name` through the client
        path rollouts use and, with replicas, on each routed replica directly (the adapter selected as the
        gateway selects it); raises `ServerRequestError` unless each answers 200 with finite logprobs, and
        `ServerCrashedError` when no replica is routed at all."""
        if self._servers.router is not None and not self._servers.routed():
            raise ServerCrashedError(
                f"no server replica is up to serve {name!r}: every one died, and the restarts have not "
                "brought one back (on a Ray cluster: no node with room for a replica; the log says why)"
            )
        targets: list[ProbeTarget] = [(self.openai_base_url, self.client_name(name), {}, self.api_key, "")]
        if self._servers.router is not None:
            model = self._aliases.get(name, self._base_id())
            adapter = {} if name in self._aliases else {"lora_path": name}
            targets += [
                (f"{r.routed_url}/v1", model, adapter, r.api_key, f" on the {r.label}")
                for r in self._servers.routed()
            ]
        await probe_chat(name, targets)

    async def close(self) -> None:
        """Stop the servers, the router, the gateway and the clients. Idempotent."""
        if self._gateway is not None:
            self._gateway.closing()  # what the stopped servers end unfinished reaches clients as errors
        await self._leases.close()
        await self._servers.close()
        if self._gateway is not None:
            self._gateway.close()
