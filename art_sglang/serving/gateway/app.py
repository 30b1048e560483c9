"""`AdapterGateway`: the loopback HTTP proxy rollouts talk to, in front of the inference server.

What it forwards and how it rewrites requests is `rules.route` (pure logic); which server a
request goes to, and what happens when none can be reached, is `upstream.Upstream` (replicas picked by the
gateway itself, a refused connection tried on another, a restart waited out). This module is the server
for the clients (aiohttp) plus what the backend needs to take a server away safely:

- `hold()` makes new requests wait (up to `hold_timeout`, then 503) instead of failing while the server's
  GPU memory is released or the server restarts; `unhold()` lets them through again. `wait_idle()` waits
  for requests in flight on a name (or on any name) to finish before an adapter is unloaded.
- `loader`: a name that is not served is offered to it first (the backend loads an older step whose
  checkpoint is on disk); the request goes on if it returns True, else it is answered 404.
- Bodies over `max_body_bytes` are refused with 413 before they are read; malformed JSON is a 400.
- A request with a sampling constraint is answered whole, each choice carrying it (`with_constraint`); so
  is one on an alias (merged weights), each choice with its weight versions, continued on the new weights
  when an update aborted it (`resend`).
- With `share_lead` set, requests of one prompt that arrive together wait until one prefill-only request
  computed it (`prefill_sharing`), so the server does not compute it once per request.
- Every response closes its connection: ART's client (httpx) looks at each idle connection it keeps
  whenever a request starts or ends, so with 256 rollouts at once it spent 13 s of CPU per 18 s (H100
  machine, 2026-11-25); a new loopback connection per request costs well under a millisecond.

It runs its own event loop in a daemon thread, so a user's event loop that blocks (e.g. a synchronous
OpenAI call inside async code) cannot stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from ...tool_choice import DEFAULT_PARSER
from ..choice_count import GENERATE_PATH
from .prefill_sharing import Answer, PrefillSharing, bad_gateway, prompt_key
from .relay import CLOSED, relay, relay_events, whole
from .resend import DRAINED, Post, with_versions
from .rules import NOT_FORWARDED, Forward, Refuse, Served, error, route, serving_version, with_constraint
from .stranded_adapters import StrandedAdapters
from .stream_resend import StreamPost, continued, sse_events, with_usage
from .upstream import Upstream

logger = logging.getLogger(__name__)

ANY = "*"  # wait_idle() on every name
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
LISTEN_BACKLOG = 4096  # connections the kernel queues for the gateway (capped by net.core.somaxconn)

Loader = Callable[[str], Awaitable[bool]]


class GatewayError(RuntimeError):
    """The gateway could not start (e.g. the port is taken)."""


class AdapterGateway:
    """Reverse proxy on `host:port` (port 0 picks a free one) in front of the server at `upstream`
    ("http://host:port"; None: none until `set_upstream`, which also names several replicas).

    `api_key`: the key rollout clients must send (None: any). `upstream_key`: the key the gateway sends to
    the server. `upstream_keep_alive`: seconds the server keeps an idle connection open. `share_lead`:
    seconds the first request of a prompt waits for another with it (None: no prefill sharing).
    `tool_call_parser`: the server's `--tool-call-parser` (what a tool_choice constrains decoding with).
    `unreachable_wait`, `upstream_keep_alive` and `replicated`: see `upstream.Upstream`.
    `set_served(...)` sets which names may be requested; until it is called nothing is served on the
    inference routes.
    """

    def __init__(
        self,
        upstream: str | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        upstream_key: str | None = None,
        hold_timeout: float = 1800.0,
        unreachable_wait: float = 0.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        upstream_keep_alive: float = 5.0,
        share_lead: float | None = None,
        tool_call_parser: str | None = DEFAULT_PARSER,
        replicated: bool = False,
    ):
        self.upstream = Upstream(
            upstream, keep_alive=upstream_keep_alive, unreachable_wait=unreachable_wait, replicated=replicated
        )
        self.host = host
        self.port = port
        self.api_key = api_key
        self.upstream_key = upstream_key
        self.hold_timeout = hold_timeout
        self.max_body_bytes = max_body_bytes
        self.loader: Loader | None = None
        self._loader_loop: asyncio.AbstractEventLoop | None = None
        self._served = Served(tool_call_parser=tool_call_parser)
        self._in_flight: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._open: asyncio.Event | None = None  # cleared while held
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._sharing = PrefillSharing(self._exchange, lead=share_lead or 0.0)
        self._sharing_on = share_lead is not None
        self.stranded = StrandedAdapters()  # names SGLang can no longer unload (stranded_adapters.py)
        self._closing = threading.Event()  # set: the servers are being stopped (see `closing`)

    # --- lifecycle (called from any thread) -------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The gateway's address, without /v1."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Bind and serve in a daemon thread; returns once the socket listens. Idempotent."""
        if self._thread is not None:
            return
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="art-sglang-gateway", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread = None
            raise GatewayError(
                f"adapter gateway could not listen on {self.host}:{self.port}: {self._start_error}"
            ) from self._start_error
        if self.upstream.replicas.routed:  # else set_upstream's line comes once there is a server
            self._log_routing()

    def closing(self) -> None:
        """The servers are about to be stopped for good: every answer still to come is a 503, and a stream
        in progress is cut off. A server being stopped ends its requests with HTTP 200 and finish_reason
        "abort", which a client would count as a successful rollout."""
        self._closing.set()

    def close(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        self._thread = None

    # --- what is served --------------------------------------------------------------------------------
    def set_served(
        self,
        adapters: Iterable[str],
        base_ids: Iterable[str] | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        """Replace the adapter names (and optionally base model ids and aliases) requests may name.

        `aliases` maps further names to a base id they are rewritten to before forwarding: with merged
        weights (`weight_sync_method="disk"`) `name@step` is served by the base model slot itself.
        """
        old = self._served
        self._served = Served(
            frozenset(adapters),
            old.base_ids if base_ids is None else frozenset(base_ids),
            old.aliases if aliases is None else dict(aliases),
            old.tool_call_parser,
        )

    @property
    def served(self) -> frozenset[str]:
        served = self._served
        return served.adapters | served.base_ids | frozenset(served.aliases)

    def set_loader(self, loader: Loader | None, loop: asyncio.AbstractEventLoop | None) -> None:
        """Offer names that are not served to `loader`, run on `loop` (the backend's)."""
        self.loader, self._loader_loop = loader, loop

    def set_upstream(self, replicas: Iterable[str], health: str | None = None) -> None:
        """Forward to `replicas` ("http://host:port" each) from now on (`Upstream.set_replicas`)."""
        before = list(self.upstream.replicas.routed)
        self.upstream.set_replicas(replicas, health)
        if list(self.upstream.replicas.routed) != before:
            self._log_routing()

    def _log_routing(self) -> None:
        routed = ", ".join(self.upstream.replicas.routed) or "no server (requests wait for one)"
        logger.info("adapter gateway on %s -> %s", self.base_url, routed)

    def set_prefill_sharing(self, enabled: bool) -> None:
        """Turn prefill sharing on or off for requests that arrive from now on."""
        self._sharing_on = enabled

    def prefill_counters(self) -> dict[str, int]:
        """What prefill sharing did since the gateway started (all zero without it)."""
        return self._sharing.counters.as_dict()

    def in_flight(self, name: str = ANY) -> int:
        """Requests being forwarded for `name` (adapter or base id), or for any name with `ANY`."""
        return self._in_flight[name]

    async def wait_idle(self, name: str = ANY, timeout: float = 600.0) -> bool:
        """Wait until no request on `name` (or on any name) is in flight; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._in_flight[name] > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def hold(self) -> None:
        """From now on new requests wait (up to `hold_timeout`, then 503) until `unhold()`."""
        await self._in_loop(False)

    async def unhold(self) -> None:
        """Let waiting and new requests through again."""
        await self._in_loop(True)

    async def _in_loop(self, value: bool) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def call() -> None:
            assert self._open is not None
            if value:
                self._open.set()
            else:
                self._open.clear()

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))

    # --- the server (runs in the gateway thread) -------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(); nothing else waits on this thread
            self._start_error = self._start_error or exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that leaves cancels its request, which closes the upstream
        # connection and so tells the server to stop generating.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await self.upstream.open(self._open)
        try:
            # A wave of rollouts opens a connection per request at once (every answer closes its own): with
            # aiohttp's backlog of 128 a wave of 256 lost some, resent 1 s later, splitting GRPO groups.
            site = web.TCPSite(runner, self.host, self.port, backlog=LISTEN_BACKLOG)
            try:
                await site.start()
            except OSError as exc:
                self._start_error = exc
                self._ready.set()
                return
            self.port = runner.addresses[0][1]  # the port bound (a free one when asked for 0)
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await self.upstream.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body exceeds the gateway's limit of {self.max_body_bytes} bytes"
            return _json(413, error(message, "request_too_large"))
        assert self._open is not None
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), self.hold_timeout)
            except asyncio.TimeoutError:
                message = f"the inference server did not come back within {self.hold_timeout:.0f} s"
                return _json(503, error(message, "service_unavailable"))
        authorized = self.api_key is None or _bearer(request) == self.api_key
        decision = route(request.method, request.raw_path, body, self._served, authorized=authorized)
        if isinstance(decision, Refuse) and decision.unknown and self.loader is not None:
            if await self._load(decision.unknown):
                decision = route(request.method, request.raw_path, body, self._served, authorized=authorized)
            else:
                decision.payload["error"]["message"] += (
                    " No checkpoint of that step is on disk to load either."
                )
        if isinstance(decision, Refuse):
            return _json(decision.status, decision.payload)
        if not authorized:
            return _json(401, error("invalid API key", "invalid_api_key"))
        if self._sharing_on or self.upstream.chooses:
            # Once per request: prefill sharing and the choice among replicas both group requests by it.
            decision = replace(decision, prompt=prompt_key(decision))
        if self._sharing_on and decision.prompt is not None:
            keys = _keys(decision)
            # Counted from here: a drain before an unload must wait for a request held in its window.
            self._count(keys, 1)
            try:
                await self._sharing.wait_turn(decision.prompt, decision, self._upstream_headers(request))
            finally:
                self._count(keys, -1)
        return await self._forward(request, decision)

    async def _load(self, names: tuple[str, ...]) -> bool:
        """Ask the loader (on the backend's loop) to load every name; False if any is not loadable."""
        loader, loop = self.loader, self._loader_loop
        if loader is None or loop is None:
            return False
        try:
            for name in names:
                future = asyncio.run_coroutine_threadsafe(loader(name), loop)
                if not await asyncio.wait_for(asyncio.wrap_future(future), self.hold_timeout):
                    return False
        except Exception:
            logger.exception("loading %s on demand failed", names)
            return False
        return True

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        if self.upstream_key is not None:
            headers["Authorization"] = f"Bearer {self.upstream_key}"
        return headers

    async def _forward(self, request: web.Request, decision: Forward) -> web.StreamResponse:
        if decision.annotated:
            # Read whole, so each choice can carry its constraint (and the tools it was prompted with).
            answer = await self._exchange(decision, self._upstream_headers(request))
            if answer.status == 200 and self._closing.is_set():
                return _json(503, CLOSED)
            if answer.status == 200:
                body = with_constraint(answer.body, decision.constraint, decision.template_tools)
                if decision.versioned:
                    resend = self._continuation_sender(decision, request) if decision.resend else None
                    body = await with_versions(decision.path, decision.payload or {}, body, resend)
                answer = Answer(answer.status, body)
            return whole(answer)
        if decision.resend:  # a stream on merged weights, continued across updates
            decision = replace(decision, body=json.dumps(with_usage(decision.payload or {})).encode())
        sent = await self._send(request.method, decision, self._upstream_headers(request))
        if isinstance(sent, Answer):
            return whole(sent)
        upstream, replica = sent
        try:
            if decision.resend and upstream.status == 200:
                async with upstream:
                    chunks = sse_events(upstream.content.iter_any())
                    serving = partial(self._serving, decision.names)  # the weights serving it, when asked
                    events = continued(
                        decision.payload or {}, chunks, serving, self._stream_sender(decision, request)
                    )
                    return await relay_events(request, events, self._closing)
            return await relay(request, upstream, self._closing, partial(self._note_refusal, decision.names))
        finally:
            self._finished(decision, replica)

    def _serving(self, names: tuple[str, ...]) -> str | None:
        return serving_version(names, self._served)

    def _note_refusal(self, names: tuple[str, ...], answer: Answer) -> None:
        self.stranded.note(names, answer.status, answer.body)

    def _stream_sender(self, decision: Forward, request: web.Request) -> StreamPost:
        """Sends the continuation of a stream an update aborted (stream_resend.py), once requests flow."""

        async def post(body: dict) -> AsyncIterator[Any]:
            assert self._open is not None
            await self._open.wait()
            continued = Forward(decision.path, json.dumps(body).encode(), decision.names, payload=body)
            return self._events(continued, request)

        return post

    async def _events(self, decision: Forward, request: web.Request) -> AsyncIterator[Any]:
        """The events of one streamed request (nothing if it failed), counted in flight while they come."""
        sent = await self._send("POST", decision, self._upstream_headers(request))
        if isinstance(sent, Answer):
            return
        upstream, replica = sent
        try:
            async with upstream:
                if upstream.status == 200:
                    async for event in sse_events(upstream.content.iter_any()):
                        yield event
        finally:
            self._finished(decision, replica)

    def _continuation_sender(self, decision: Forward, request: web.Request) -> Post:
        """Posts the continuation of a request an update aborted (resend.py), once the gateway lets requests
        through again (the push holds them until the servers serve the new weights)."""

        async def post(body: dict) -> tuple[int, bytes]:
            assert self._open is not None
            await self._open.wait()
            continued = Forward(GENERATE_PATH, json.dumps(body).encode(), decision.names, payload=body)
            answer = await self._exchange(continued, self._upstream_headers(request))
            return answer.status, answer.body

        return post

    async def _exchange(self, decision: Forward, headers: dict[str, str]) -> Answer:
        """POST `decision` and read the whole answer (for prefill sharing)."""
        sent = await self._send("POST", decision, headers)
        if isinstance(sent, Answer):
            return sent
        upstream, replica = sent
        try:
            async with upstream:
                answer = Answer(upstream.status, await upstream.read())
            self.stranded.note(decision.names, answer.status, answer.body)
            return answer
        except aiohttp.ClientError as exc:
            return bad_gateway(f"the inference server at {replica} failed: {exc!r}")
        finally:
            self._finished(decision, replica)

    async def _send(
        self, method: str, decision: Forward, headers: dict[str, str]
    ) -> tuple[aiohttp.ClientResponse, str] | Answer:
        """Send the request upstream; its names count in flight while a try is under way (until
        `_finished` once it was answered)."""
        keys = _keys(decision)
        return await self.upstream.send(method, decision, headers, lambda delta: self._count(keys, delta))

    def _finished(self, decision: Forward, replica: str) -> None:
        """A request `_send` sent to `replica` is over."""
        self._count(_keys(decision), -1)
        self.upstream.finished(replica)

    def _count(self, keys: tuple[str, ...], delta: int) -> None:
        for key in keys:
            self._in_flight[key] += delta


def _keys(decision: Forward) -> tuple[str, ...]:
    """The in-flight counters a request counts in: each name it asks for, and every request's."""
    drained = (DRAINED,) if decision.aliased and not decision.resend else ()
    return (*(decision.names or ("",)), *drained, ANY)


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _json(status: int, payload: dict) -> web.Response:
    return whole(Answer(status, json.dumps(payload).encode()))
