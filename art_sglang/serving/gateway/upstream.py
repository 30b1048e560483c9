"""`Upstream`: the adapter gateway's side towards the inference servers — its HTTP clients, which replica
each request goes to (`balancer.ReplicaChoice`), and what it does when a server cannot be reached:

- With several replicas the replica of each request is picked here, not by SGLang's router, which would
  re-encode the request and drop fields rollouts need (`return_token_ids` among them). The router's list
  of healthy replicas is read every `HEALTH_POLL_S`; the ones it finds failing are passed over.
- A request whose connection a replica refuses goes to another; with none left (one server that died and
  the watchdog is restarting) it waits up to `unreachable_wait` seconds for one to come back instead of
  failing with 502. With replicas (`replicated`) and none routed it is answered 503 at once: a replica's
  start takes minutes, and on a Ray cluster without room for one it never comes.
- Pooled connections idle for half the server's keep-alive are not reused (one the server closes as it is
  reused fails); a request whose connection breaks before any answer is resent once, on a new connection.

Runs on the gateway's event loop (`open` there); `set_replicas` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable

import aiohttp

from .balancer import ReplicaChoice, affinity_key
from .prefill_sharing import Answer, bad_gateway
from .rules import Forward, error

# How often the router's list of healthy replicas is read (its own checks run every second).
HEALTH_POLL_S = 0.5
_UNREACHABLE_POLL_S = 0.2

Counted = Callable[[int], None]


class Upstream:
    """The servers at `upstream` ("http://host:port"; None: none until `set_replicas`). `keep_alive`:
    seconds a server keeps an idle connection open; `unreachable_wait` and `replicated`: see the module."""

    def __init__(self, upstream: str | None, *, keep_alive: float, unreachable_wait: float, replicated: bool):
        self.replicas = ReplicaChoice([] if upstream is None else [upstream.rstrip("/")])
        self.unreachable_wait = unreachable_wait
        self._keep_alive = keep_alive
        self._replicated = replicated
        self._health_url: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection per request, for resends
        self._health: asyncio.Task[None] | None = None
        self._open: asyncio.Event | None = None

    def set_replicas(self, replicas: Iterable[str], health: str | None = None) -> None:
        """Send to `replicas` from now on; none: requests wait for one. `health`: SGLang's router routing to
        them, whose health checks decide which are passed over."""
        # Pooled connections to an earlier server fail once and are replaced by aiohttp.
        self.replicas.set_routed(url.rstrip("/") for url in replicas)
        self._health_url = health
        if health is None:
            self.replicas.set_healthy(None)

    async def open(self, gateway_open: asyncio.Event) -> None:
        """Create the clients; `gateway_open` is cleared while the gateway holds requests (a request
        waiting for a server waits for it too)."""
        self._open = gateway_open
        self._session = _client(aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keep_alive / 2))
        self._fresh = _client(aiohttp.TCPConnector(limit=0, force_close=True))
        self._health = asyncio.ensure_future(self._watch_health())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    @property
    def chooses(self) -> bool:
        """Whether each request's replica is chosen (among several routed)."""
        return len(self.replicas.routed) > 1

    async def send(
        self, method: str, decision: Forward, headers: dict[str, str], counted: Counted
    ) -> tuple[aiohttp.ClientResponse, str] | Answer:
        """Send the request to a replica; the server's response and the replica (the request in flight on
        it until `finished`), or the gateway's error response. `counted(+1)` runs before each try and
        `counted(-1)` after a failed one, so a request waiting for a server does not count in flight."""
        assert self._session is not None and self._fresh is not None and self._open is not None
        deadline = time.monotonic() + self.unreachable_wait
        # Only a choice among replicas needs the keys (a prompt's serialization, for long ones a fraction
        # of a millisecond; the gateway made the prompt's once).
        group, affinity = (decision.prompt, affinity_key(decision)) if self.chooses else (None, None)
        refused: dict[str, str] = {}  # replica -> why, for this request
        resent = False
        while True:
            replica = self.replicas.pick(group, affinity, avoid=refused)
            if replica is None and self._replicated and not self.replicas.routed:
                message = (
                    "no inference server replica is up: every one died, and the restarts have not brought "
                    "one back yet (on a Ray cluster: no node with room for a replica)"
                )
                return Answer(503, json.dumps(error(message, "service_unavailable")).encode())
            if replica is None:
                # Every routed replica refused this request's connection (or none is routed): wait.
                if time.monotonic() >= deadline:
                    problem = "; ".join(refused.values()) or "no inference server is up"
                    return bad_gateway(f"the inference server is not reachable: {problem}")
                await asyncio.sleep(_UNREACHABLE_POLL_S)
                await self._open.wait()
                refused.clear()
                continue
            counted(1)
            session = self._fresh if resent else self._session  # never a second pooled connection
            try:
                response = await session.request(
                    method, replica + decision.path, data=decision.body, headers=headers
                )
                return response, replica
            except aiohttp.ClientConnectorError as exc:
                self._failed(replica, counted)
                # Nothing reached the server: sending it to another, or again after a restart, is safe.
                self.replicas.unreachable(replica)
                refused[replica] = f"{replica}: {exc}"
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                self._failed(replica, counted)
                # The connection broke before any answer: the server died (a kept-alive connection to it
                # is only found broken when reused) or closed it as it was reused. Every forwarded route
                # is free of side effects, so the request is sent once more, on a new connection (to
                # another replica if this one refuses it, or after a restart); only once, so a request
                # that itself kills a server cannot take it down again and again.
                if resent or time.monotonic() >= deadline:
                    return bad_gateway(f"the inference server at {replica} failed: {exc!r}")
                resent = True
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._failed(replica, counted)
                return bad_gateway(f"the inference server at {replica} failed: {exc!r}")
            except BaseException:
                self._failed(replica, counted)
                raise

    def finished(self, replica: str) -> None:
        """A request `send` sent to `replica` is over."""
        self.replicas.done(replica)

    def _failed(self, replica: str, counted: Counted) -> None:
        counted(-1)
        self.replicas.done(replica)

    async def _watch_health(self) -> None:
        """Pass over the replicas SGLang's router finds failing (its list of workers, read every
        `HEALTH_POLL_S`); while the router does not answer, every routed replica counts."""
        assert self._fresh is not None
        while True:
            url = self._health_url
            if url is not None:
                try:
                    async with self._fresh.get(f"{url}/workers") as response:
                        workers = (await response.json()).get("workers", [])
                    self.replicas.set_healthy(w["url"] for w in workers if w.get("is_healthy"))
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, AttributeError):
                    self.replicas.set_healthy(None)
            await asyncio.sleep(HEALTH_POLL_S)


def _client(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # No cookie jar: cookies the server sets belong to the client that asked, not to every client.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )
