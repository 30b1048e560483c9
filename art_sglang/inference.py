"""`InferenceService`: the one inference server of a backend, kept in a known state.

It owns the server process, its admin client, the `AdapterGateway` in front of it, the adapters that must
be loaded, the aliases served by the base slot and the base weights the server must hold. All of that is
private; callers (the backend, the weight-sync strategies, the GPU handoff) change it only through the
commands below, and each command keeps one invariant: **a name the gateway routes is loaded on the
server**. Whenever the server (re)starts — first start, a weight-sync restart, the shared-mode restart,
crash recovery — the gateway holds new requests until every wanted adapter (and the base weights) is
loaded again. Names are routed only after the server loaded them and stop being routed before they are
unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Literal

import httpx

from .config import SGLangConfig
from .errors import AdapterLoadError, ServerCrashedError, ServerRequestError
from .model_store import check_adapter
from .process_tree import EXIT_GRACE_SECONDS
from .server.client import MEMORY_TAGS, WEIGHTS_TAG, ServerClient
from .server.gateway import ANY, AdapterGateway
from .server.process import ServerProcess

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0
# A server being replaced because it died or hangs gets this long to exit on SIGTERM before SIGKILL.
_HUNG_GRACE_S = 5.0


class InferenceService:
    """Server process + admin client + gateway + what the server must hold (adapters, base weights)."""

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
    ):
        self._config = config
        self._base_model = base_model
        self._process = ServerProcess(config, base_model, engine=engine, log_path=log_path, gpu_ids=gpu_ids)
        self._gateway: AdapterGateway | None = None
        if use_gateway:
            # A request the dead server refuses waits for the restart (as long as a start may take).
            self._gateway = AdapterGateway(
                "http://127.0.0.1:0",
                api_key=config.api_key,
                upstream_key=config.api_key,
                unreachable_wait=config.server_timeout,
            )
        self._find_checkpoint: Callable[[str], Path | None] | None = None
        self._drain_timeout = drain_timeout
        self._adapters: dict[str, Path] = {}  # loaded (and wanted after every start), oldest first
        self._leases: Counter[str] = Counter()  # names rollouts hold: never unloaded while held
        self._unloading: set[str] = set()  # no longer routed, still loaded until their requests finish
        self._aliases: dict[str, str] = {}  # names served by the base slot (merged weights)
        self._base_ids: list[str] = []
        self._base_weights: Path | None = None  # merged weights the base slot holds; None = the original
        self._client: ServerClient | None = None
        # Whether the server is meant to serve now: False before the first start, while the trainer has
        # the GPU (shared mode) and after close(). Crash recovery restarts only a server meant to serve.
        self._serving = False
        self._released_tags: tuple[str, ...] = ()  # GPU memory kinds released for the trainer
        self._unanswered_since: float | None = None  # first failed health check in a row
        self._holds = 0  # nested holds of the gateway; requests wait while > 0
        self._lock = asyncio.Lock()  # one command at a time changes the server

    # --- what others may read ----------------------------------------------------------------------------
    @property
    def base_model(self) -> str:
        return self._base_model

    @property
    def process(self) -> ServerProcess:
        """The server process (read its pid, address and liveness; start and stop it through the service)."""
        return self._process

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
        root = self._gateway.base_url if self._gateway is not None else self._process.base_url
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
        """Stop the server and start it again, requests held meanwhile."""
        async with self._lock, self.holding():
            await self._process.stop()
            await self._bring_up()

    async def stop(self) -> None:
        """Stop the server on purpose (shared mode "restart"): crash recovery leaves it down until
        `start()`. Requests wait while the gateway is held, else fail with 502."""
        async with self._lock:
            self._serving = False
            await self._process.stop()

    async def recover(self) -> bool:
        """Restart a server that should serve but died, or has not answered `GET /health` for
        `unresponsive_timeout` seconds (hung or stopped), with every adapter loaded again before a request
        reaches it. Returns whether it restarted the server. Does nothing while another command runs."""
        if not self._serving or self._lock.locked():
            return False
        if self._process.is_alive():
            problem = await self._unresponsive()
            if problem is None:
                return False
        else:
            problem = "died"
        async with self._lock:
            if not self._serving:
                return False
            logger.warning(
                "the inference server %s; restarting it. Last lines of its log:\n%s",
                problem,
                self._process.log_tail(),
            )
            # Requests in flight are lost with the process; none is waited for.
            async with self.holding(drain=False):
                await self._process.stop(timeout=_HUNG_GRACE_S)
                await self._bring_up()
            return True

    async def _unresponsive(self) -> str | None:
        """What is wrong with a running server that does not answer health checks long enough, else None."""
        timeout = self._config.unresponsive_timeout
        if self._client is not None and await self._client.health(timeout=min(timeout, 10.0)):
            self._unanswered_since = None
            return None
        now = time.monotonic()
        if self._unanswered_since is None:
            self._unanswered_since = now
        if now - self._unanswered_since < timeout:
            return None
        self._unanswered_since = None
        return f"did not answer GET /health for {timeout:g} s"

    async def close(self) -> None:
        """Stop the server, the gateway and the client. Idempotent. The server gets the short grace period:
        at close nothing on it is worth waiting for, and SGLang's scheduler sleeps 5 s on SIGTERM."""
        self._serving = False
        await self._process.stop(timeout=EXIT_GRACE_SECONDS)
        if self._gateway is not None:
            self._gateway.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _bring_up(self) -> bool:
        """Start the server if needed and load what it must hold, the gateway held meanwhile (the one place
        that enforces the invariant after a start). Call with the lock held."""
        if self._process.is_alive() and self._client is not None:
            return False
        # Nothing to drain: the callers that stop a serving server drained it first.
        async with self.holding(drain=False):
            began = time.monotonic()
            await self._process.start()
            if self._client is not None:
                await self._client.aclose()
            self._client = ServerClient(self._process.base_url, api_key=self._config.api_key)
            self._base_ids = [card.id for card in await self._client.list_models() if card.parent is None]
            if self._base_weights is not None:
                # A fresh process holds the original base weights; the merged ones are applied again.
                await self._client.update_weights_from_disk(str(self._base_weights))
            for name, path in self._adapters.items():
                await self._load_on_server(name, path)
            if self._gateway is not None:
                self._gateway.set_upstream(self._process.base_url)
                self._gateway.start()
            self._publish()
            self._serving = True
            logger.info(
                "inference server ready at %s (%.1f s); adapters: %s",
                self._process.base_url,
                time.monotonic() - began,
                ", ".join(self._adapters) or "none",
            )
        return True

    def _admin(self) -> ServerClient:
        if self._client is None:
            raise ServerCrashedError("the inference server is not running: start it first")
        return self._client

    # --- shared mode: GPU memory ---------------------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the server's GPU memory of the kinds in `tags` (None = all) for the trainer (hold requests
        first); the process stays."""
        async with self._lock:
            self._serving = False
            if self._process.is_alive():
                await self._admin().release_memory_occupation(tags)
            self._released_tags = tuple(tags) if tags is not None else MEMORY_TAGS

    async def resume_memory(self) -> bool:
        """Take back what `release_memory` freed. When the weights were released, every adapter is loaded
        again (whether the LoRA pool survives that is SGLang's internal business, and reloading costs
        milliseconds); after a KV-cache-only release the adapters were never touched. A server that died
        meanwhile is started instead. Returns whether a server process was started."""
        async with self._lock:
            tags, self._released_tags = self._released_tags, ()
            if not self._process.is_alive():
                return await self._bring_up()
            async with self.holding():
                client = self._admin()
                if tags:
                    await client.resume_memory_occupation(list(tags))
                if WEIGHTS_TAG in tags:
                    for name, path in self._adapters.items():
                        with contextlib.suppress(ServerRequestError):  # already gone with the release
                            await client.unload_lora_adapter(name)
                        await self._load_on_server(name, path)
                self._serving = True
            return False

    # --- adapters --------------------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: Path) -> None:
        """Load `path` as `name` (checked locally first), then route it. No-op if already loaded."""
        async with self._lock:
            if name in self._adapters:
                return
            if name not in self._unloading:  # else still on the server: routing it again is enough
                await self._load_on_server(name, path)
            self._adapters[name] = path
            self._publish()

    async def remove_adapter(self, name: str) -> None:
        """Stop routing `name`, wait for its requests in flight, then unload it from the server. A leased
        name stays (see `lease`)."""
        async with self._lock:
            if self._leases[name] > 0 or self._adapters.pop(name, None) is None:
                return
            self._unloading.add(name)
            self._publish()
        try:
            if not await self._wait_unused(name):
                logger.warning(
                    "requests on %s still in flight after %.0f s; unloading", name, self._drain_timeout
                )
            async with self._lock:
                if name in self._adapters or not self._process.is_alive():
                    return  # loaded again meanwhile, or gone with the process
                try:
                    await self._admin().unload_lora_adapter(name)
                except ServerRequestError as exc:
                    logger.warning("unloading %s failed: %s", name, exc)
        finally:
            self._unloading.discard(name)

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
            await self._process.stop()
            await self._bring_up()

    async def _load_on_server(self, name: str, path: Path) -> None:
        check_adapter(path, self._config.max_lora_rank)
        try:
            await self._admin().load_lora_adapter(name, str(path))
        except AdapterLoadError as exc:
            raise AdapterLoadError(
                f"the server refused adapter {name!r} from {path}: {exc}",
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
                await self._admin().update_weights_from_disk(str(path or self._base_model))
                # The prefix cache holds keys/values computed with the old weights of the same slot.
                await self._admin().flush_cache()
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

    # --- checks ----------------------------------------------------------------------------------------
    async def probe(self, name: str) -> None:
        """One greedy one-token chat completion on `name` through the client path rollouts use; raises
        `ServerRequestError` unless it answers 200."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        body = {
            "model": self.client_name(name),
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as http:
            response = await http.post(f"{self.openai_base_url}/chat/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise ServerRequestError(
                f"probe request on {name!r} failed with HTTP {response.status_code}: {response.text[:500]}",
                status=response.status_code,
                server_message=response.text,
            )

    async def flush_cache(self) -> None:
        async with self._lock:
            await self._admin().flush_cache()


def _step_of(name: str) -> int:
    """The step of `<model>@<step>` (-1 for another form)."""
    step = name.rpartition("@")[2]
    return int(step) if step.isdigit() else -1
