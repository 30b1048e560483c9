"""`InferenceService`: the one inference server of a backend, kept in a known state.

It owns the server process, its admin client, the `AdapterGateway` in front of it, and the list of
adapters that must be loaded. Whenever the server (re)starts — first start, restart, crash recovery — every
adapter on that list is loaded again before the service reports ready, so a name the backend hands out is
always loaded. Names are added to the gateway only after the server loaded them and removed from it before
they are unloaded, so a request can never reach the server for a name it does not have.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx

from .config import SGLangConfig
from .errors import AdapterLoadError, ServerCrashedError, ServerRequestError
from .model_store import check_adapter
from .server.client import ServerClient
from .server.gateway import ANY, AdapterGateway
from .server.process import ServerProcess

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0


class InferenceService:
    """Server process + admin client + gateway + the adapters that must be loaded (name -> directory)."""

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
        self.config = config
        self.base_model = base_model
        self.process = ServerProcess(config, base_model, engine=engine, log_path=log_path, gpu_ids=gpu_ids)
        self.gateway: AdapterGateway | None = None
        if use_gateway:
            self.gateway = AdapterGateway("http://127.0.0.1:0", api_key=config.api_key)
        self.drain_timeout = drain_timeout
        self.adapters: dict[str, Path] = {}  # wanted on the server, oldest first
        self.aliases: dict[str, str] = {}  # served by the base slot (merged weights), see weight_sync
        self.base_ids: list[str] = []
        self.client: ServerClient | None = None
        self.released = False
        self.merged_weights: Path | None = None  # applied after every start (weight_sync_method="disk")
        self.starts = 0  # how many times the server process was started

    # --- addresses -------------------------------------------------------------------------------------
    @property
    def openai_base_url(self) -> str:
        """What models' OpenAI clients use: the gateway when on, else the server itself (with /v1)."""
        root = self.gateway.base_url if self.gateway is not None else self.process.base_url
        return f"{root}/v1"

    @property
    def api_key(self) -> str:
        # The OpenAI client insists on a key; the server ignores it unless it was started with one.
        return self.config.api_key or "default"

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the server (if not running), load every wanted adapter, then open the gateway to them."""
        started = time.monotonic()
        await self.process.start()
        self.starts += 1
        if self.client is not None:
            await self.client.aclose()
        self.client = ServerClient(self.process.base_url, api_key=self.config.api_key)
        self.released = False
        self.base_ids = [card.id for card in await self.client.list_models() if card.parent is None]
        if self.merged_weights is not None:
            # A fresh process holds the original base weights; merged ones are applied again first.
            await self.client.update_weights_from_disk(str(self.merged_weights))
        for name, path in self.adapters.items():
            await self._load_on_server(name, path)
        if self.gateway is not None:
            self.gateway.set_upstream(self.process.base_url)
            self.gateway.start()
            self._publish()
        logger.info(
            "inference server ready at %s (%.1f s); adapters: %s",
            self.process.base_url,
            time.monotonic() - started,
            ", ".join(self.adapters) or "none",
        )

    async def stop(self) -> None:
        """Stop the server process (the gateway stays; its requests wait while held, else fail with 502)."""
        await self.process.stop()
        self.released = False

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def close(self) -> None:
        """Stop the server, the gateway and the client. Idempotent."""
        await self.process.stop()
        if self.gateway is not None:
            self.gateway.close()
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def ensure_running(self) -> None:
        """Restart a server that died (crash recovery): it comes back with every wanted adapter loaded."""
        try:
            self.process.check_alive()
        except ServerCrashedError as exc:
            logger.warning("inference server is down, restarting it: %s", exc)
            await self.start()

    def _admin(self) -> ServerClient:
        if self.client is None:
            raise ServerCrashedError("the inference server is not running: start it first")
        return self.client

    # --- taking the server away and giving it back -------------------------------------------------------
    async def hold(self) -> None:
        """New requests wait from now on; returns once the ones in flight finished."""
        if self.gateway is None:
            return
        await self.gateway.hold()
        if not await self.gateway.wait_idle(ANY, self.drain_timeout):
            logger.warning("requests still in flight after %.0f s; going on", self.drain_timeout)

    async def unhold(self) -> None:
        if self.gateway is not None:
            await self.gateway.release()

    async def release_memory(self) -> None:
        await self._admin().release_memory_occupation()
        self.released = True

    async def resume_memory(self) -> None:
        """Resume the released memory, then load every adapter again: whether the LoRA pool survives a
        release is SGLang's internal business, and reloading costs milliseconds, so nothing is assumed."""
        client = self._admin()
        await client.resume_memory_occupation()
        self.released = False
        for name, path in self.adapters.items():
            with contextlib.suppress(ServerRequestError):  # already gone with the release
                await client.unload_lora_adapter(name)
            await self._load_on_server(name, path)

    # --- adapters --------------------------------------------------------------------------------------
    async def load(self, name: str, path: Path) -> None:
        """Load `path` as `name` (checked locally first) and serve it through the gateway."""
        if name in self.adapters:
            return
        await self._load_on_server(name, path)
        self.adapters[name] = path
        self._publish()

    async def _load_on_server(self, name: str, path: Path) -> None:
        check_adapter(path, self.config.max_lora_rank)
        try:
            await self._admin().load_lora_adapter(name, str(path))
        except AdapterLoadError as exc:
            raise AdapterLoadError(
                f"the server refused adapter {name!r} from {path}: {exc}",
                status=exc.status,
                server_message=exc.server_message,
            ) from exc

    async def unload(self, name: str) -> None:
        """Stop routing `name`, wait for its requests in flight, then unload it from the server."""
        if name not in self.adapters:
            return
        del self.adapters[name]
        self._publish()
        if self.gateway is not None and not await self.gateway.wait_idle(name, self.drain_timeout):
            logger.warning("requests on %s still in flight after %.0f s; unloading", name, self.drain_timeout)
        try:
            await self._admin().unload_lora_adapter(name)
        except ServerRequestError as exc:
            logger.warning("unloading %s failed: %s", name, exc)

    async def keep_newest(self, prefix: str, keep: int) -> None:
        """Unload all but the `keep` newest adapters whose name starts with `prefix`."""
        mine = [name for name in self.adapters if name.startswith(prefix)]
        for name in mine[: max(len(mine) - keep, 0)]:
            await self.unload(name)

    def set_alias(self, name: str, prefix: str) -> None:
        """Serve `name` with the base slot (merged weights), replacing earlier aliases starting `prefix`."""
        self.aliases = {k: v for k, v in self.aliases.items() if not k.startswith(prefix)}
        self.aliases[name] = self.base_ids[0] if self.base_ids else self.base_model
        self._publish()

    def _publish(self) -> None:
        if self.gateway is not None:
            self.gateway.set_served(self.adapters, self.base_ids, self.aliases)

    def serves(self, name: str) -> bool:
        return name in self.adapters or name in self.aliases

    def client_name(self, name: str) -> str:
        """The `model` a client sends to be served `name`: the name itself through the gateway. Without
        the gateway, SGLang's own `<base>:<adapter>` form (a bare adapter name is answered by the base
        model) or, for an alias, the base id."""
        if self.gateway is not None:
            return name
        if name in self.aliases:
            return self.aliases[name]
        return f"{self.base_ids[0] if self.base_ids else self.base_model}:{name}"

    # --- checks ----------------------------------------------------------------------------------------
    async def loaded_on_server(self) -> list[str]:
        """Adapter names the server itself lists in /v1/models."""
        return [card.id for card in await self._admin().list_models() if card.parent is not None]

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
        await self._admin().flush_cache()
