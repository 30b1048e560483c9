"""`AdapterGateway`: a small HTTP reverse proxy in front of the inference server that routes a model
name to its adapter and refuses names the server does not have loaded.

Why: SGLang 0.5.17 selects an adapter only by `model="<base>:<adapter>"` or the `lora_path` field; a bare
`model="<adapter>"` is answered with HTTP 200 *by the base model*, the requested name echoed back, whether
or not an adapter of that name is loaded (the golden recording shows both). A rollout on the wrong weights
would look like success. The gateway reads the `model` (and `lora_path`) field of `/v1/chat/completions`,
`/v1/completions` and `/generate`; a name the backend has loaded is forwarded with `lora_path` set to it
(the response still echoes the name the client sent), the base model's ids pass as they are, and any other
name is answered with HTTP 404 in OpenAI's error shape, listing the names that are served. Every other path
is passed through unchanged; responses are streamed.

A non-streaming chat or text completion on an adapter (or an alias) also gets `return_token_ids: true`
unless the client set the field itself, so each Choice carries the ids the server sampled (`token_ids`)
and the trainer trains on exactly those instead of re-tokenizing the text. Streaming requests are left
alone: SGLang 0.5.17's stream chunks are not recorded carrying the ids, so a rollout that needs exact ids
should not stream.

It also lets the backend take the server away safely: `hold()` makes new requests wait (instead of
failing) while the server's GPU memory is released or the server restarts, and `wait_idle()` waits for requests in flight on a
name (or on any name) to finish before an adapter is unloaded or memory is released.

The gateway runs its own event loop in a daemon thread, so a user's event loop that blocks (e.g. a
synchronous OpenAI call inside async code) cannot stall it. HTTP/1.1 is spoken with h11 (a dependency of
httpx) on both sides, over a small pool of keep-alive connections to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import h11

logger = logging.getLogger(__name__)

ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
# Paths whose Choices can carry the sampled ids (`return_token_ids`).
TOKEN_ID_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Hop-by-hop headers (RFC 9110 7.6.1) are not forwarded; h11 frames each side itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_READ_SIZE = 65536
_MAX_IDLE = 256  # idle upstream connections kept for reuse
ANY = "*"  # wait_idle() on every name


class GatewayError(RuntimeError):
    """The gateway could not start (e.g. the port is taken)."""


class AdapterGateway:
    """Reverse proxy on `host:port` (port 0 picks a free one) in front of `upstream` ("http://host:port").

    `set_served(adapters, base_ids)` sets which names may be requested; until it is called nothing is
    served on the routed paths.
    """

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        hold_timeout: float = 1800.0,
    ):
        self.upstream = upstream.rstrip("/")
        self.host = host
        self.port = port
        self.api_key = api_key
        self.hold_timeout = hold_timeout
        self._adapters: frozenset[str] = frozenset()
        self._base_ids: frozenset[str] = frozenset()
        self._aliases: dict[str, str] = {}
        self._in_flight: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._open: asyncio.Event | None = None  # cleared while held
        self._ready = threading.Event()
        self._pool: _UpstreamPool | None = None
        self._start_error: BaseException | None = None

    # --- lifecycle (called from any thread) -------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The gateway's address, without /v1."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Bind and serve in a daemon thread; returns once the socket listens. Idempotent."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="art-sglang-gateway", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread = None
            raise GatewayError(
                f"adapter gateway could not listen on {self.host}:{self.port}: {self._start_error}"
            ) from self._start_error
        logger.info("adapter gateway on %s -> %s", self.base_url, self.upstream)

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
        """Replace the adapter names (and optionally base model ids) requests may name.

        `aliases` maps further names to a base id they are rewritten to before forwarding: with merged
        weights (`weight_sync_method="disk"`) `name@step` is served by the base model slot itself.
        """
        if aliases is not None:
            self._aliases = dict(aliases)
        if base_ids is not None:
            self._base_ids = frozenset(base_ids)
        self._adapters = frozenset(adapters)

    @property
    def served(self) -> frozenset[str]:
        return self._adapters | self._base_ids | frozenset(self._aliases)

    def set_upstream(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        if self._pool is not None and self._loop is not None:
            # Connections to an earlier server are useless; the new pool is swapped in on the gateway's loop.
            pool = _UpstreamPool(self.upstream)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._swap_pool, pool)

    def _swap_pool(self, pool: _UpstreamPool) -> None:
        old, self._pool = self._pool, pool
        if old is not None:
            old.close()

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
        await self._in_loop(self._set_open, False)

    async def unhold(self) -> None:
        """Let waiting and new requests through again."""
        await self._in_loop(self._set_open, True)

    async def _in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def call() -> None:
            fn(*args)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))

    def _set_open(self, value: bool) -> None:
        assert self._open is not None
        if value:
            self._open.set()
        else:
            self._open.clear()

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
        try:
            server = await asyncio.start_server(self._connection, self.host, self.port)
        except OSError as exc:
            self._start_error = exc
            self._ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._pool = _UpstreamPool(self.upstream)
        async with server:
            self._ready.set()
            await self._stop.wait()
            server.close()
            self._pool.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                received = await _read_request(conn, reader)
                if received is None:
                    break
                request, body = received
                await self._serve(conn, writer, request, body)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            with contextlib.suppress(Exception):
                await _send_json(conn, writer, 400, {"error": {"message": f"bad HTTP request: {exc}"}})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            # Only the gateway's shutdown cancels a connection; ending quietly keeps asyncio's server
            # callback from logging every open keep-alive connection as an error.
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes
    ) -> None:
        assert self._open is not None
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), self.hold_timeout)
            except asyncio.TimeoutError:
                message = f"the inference server did not come back within {self.hold_timeout:.0f} s"
                await _send_json(conn, writer, 503, _error(message, "service_unavailable", None))
                return
        target = request.target.decode("latin-1")
        path = target.split("?", 1)[0]
        names: list[str] = []
        if request.method == b"POST" and path in ROUTED_PATHS:
            payload = _json_object(body)
            names = _requested_names(payload)
            refusal = self._refusal(request, names)
            if refusal is not None:
                await _send_json(conn, writer, *refusal)
                return
            if payload is not None and self._route(payload, path in TOKEN_ID_PATHS):
                body = json.dumps(payload).encode()
        keys = names or [""]
        for key in (*keys, ANY):
            self._in_flight[key] += 1
        try:
            await self._forward(conn, writer, request, target, body)
        finally:
            for key in (*keys, ANY):
                self._in_flight[key] -= 1

    def _refusal(self, request: h11.Request, names: list[str]) -> tuple[int, dict] | None:
        unknown = [name for name in names if not self._is_served(name)]
        if not unknown:
            return None
        if self.api_key is not None and _bearer(request) != self.api_key:
            # Do not list the served names to a caller without the key; the server would say 401 too.
            return 401, _error("invalid API key", "invalid_api_key", None)
        served = sorted(self._adapters) or ["(no adapter loaded)"]
        message = (
            f"The model `{unknown[0]}` is not loaded on the inference server, so it would have been "
            f"answered by the base model. Loaded adapters: {', '.join(served)}. "
            "Use model.get_inference_name() for the current step."
        )
        return 404, _error(message, "model_not_found", "model")

    def _route(self, payload: dict, token_ids: bool) -> bool:
        """Make the server use the adapter the client named; True if `payload` was changed.

        A loaded adapter named by `model` gets `lora_path` (a bare name alone would be the base model); an
        alias is replaced by its base id, in `model` and in `lora_path`. With `token_ids`, a non-streaming
        request on an adapter or alias asks for the sampled ids unless the client decided itself."""
        changed = False
        model = payload.get("model")
        lora = payload.get("lora_path")
        if (
            token_ids
            and "return_token_ids" not in payload
            and not payload.get("stream")
            and any(self._is_trained(name) for name in (model, lora))
        ):
            payload["return_token_ids"] = True
            changed = True
        if isinstance(model, str):
            if model in self._aliases:
                payload["model"] = self._aliases[model]
                changed = True
            elif model in self._adapters and not payload.get("lora_path"):
                payload["lora_path"] = model
                changed = True
        lora = payload.get("lora_path")
        if isinstance(lora, str) and lora in self._aliases:
            del payload["lora_path"]
            changed = True
        elif isinstance(lora, list) and any(item in self._aliases for item in lora):
            payload["lora_path"] = [None if item in self._aliases else item for item in lora]
            changed = True
        return changed

    def _is_trained(self, name: object) -> bool:
        """Whether `name` selects a trained model: an adapter, an alias, or "<base>:<adapter>"."""
        if not isinstance(name, str):
            return False
        if name in self._adapters or name in self._aliases:
            return True
        base, sep, adapter = name.partition(":")
        return bool(sep) and base in self._base_ids and adapter in self._adapters

    def _is_served(self, name: str) -> bool:
        # SGLang also accepts "<base>:<adapter>" (see _is_trained).
        return name in self._base_ids or self._is_trained(name)

    async def _forward(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        request: h11.Request,
        target: str,
        body: bytes,
    ) -> None:
        assert self._pool is not None
        pool = self._pool
        headers = [(k, v) for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
        head = h11.Request(
            method=request.method,
            target=target,
            headers=[("host", pool.authority), *headers, ("content-length", str(len(body)))],
        )
        upstream: _Exchange | None = None
        try:
            upstream = await pool.exchange(head, body)
        except (OSError, asyncio.IncompleteReadError, h11.ProtocolError) as exc:
            message = f"the inference server at {self.upstream} is not reachable: {exc!r}"
            await _send_json(conn, writer, 502, _error(message, "bad_gateway", None))
            return
        reusable = False
        try:
            response = upstream.response
            out_headers = [
                (k, v) for k, v in response.headers if k not in _HOP_BY_HOP or k == b"content-length"
            ]
            writer.write(
                conn.send(h11.Response(status_code=response.status_code, headers=out_headers)) or b""
            )
            try:
                async for chunk in upstream.body():
                    writer.write(conn.send(h11.Data(data=chunk)) or b"")
                    await writer.drain()
            except (OSError, asyncio.IncompleteReadError, h11.ProtocolError):
                # The server died mid-response: the client sees a truncated response and an error.
                conn.send_failed()
                raise ConnectionError("upstream failed mid-response") from None
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            reusable = upstream.reusable()
        finally:
            # A response not read to its end (the client left) closes its connection, which also tells the
            # server to stop generating.
            pool.release(upstream, reusable)


class _Exchange:
    """One request/response on an upstream connection; `body()` yields the response body as it comes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: h11.Connection):
        self.reader, self.writer, self.client = reader, writer, client
        self.response: h11.Response

    async def next_event(self) -> h11.Event:
        while True:
            event = self.client.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(_READ_SIZE)
            if not data and self.client.their_state is h11.SEND_RESPONSE:
                raise asyncio.IncompleteReadError(b"", None)  # closed before answering
            self.client.receive_data(data)

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    def reusable(self) -> bool:
        return self.client.our_state is h11.DONE and self.client.their_state is h11.DONE


class _UpstreamPool:
    """Keep-alive HTTP/1.1 connections to the server (h11 over asyncio streams: far less work per request
    than a general-purpose client)."""

    def __init__(self, url: str):
        parsed = urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.authority = parsed.netloc
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def exchange(self, head: h11.Request, body: bytes) -> _Exchange:
        """Send a request and read the response head; a pooled connection the server already closed is
        replaced by a fresh one once (nothing reached the server on it)."""
        while True:
            pooled = bool(self._idle)
            reader, writer = (
                self._idle.pop() if pooled else await asyncio.open_connection(self.host, self.port)
            )
            client = h11.Connection(h11.CLIENT)
            exchange = _Exchange(reader, writer, client)
            try:
                writer.write(
                    client.send(head) + client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())
                )
                await writer.drain()
                event = await exchange.next_event()
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
                if pooled:
                    continue
                raise
            if not isinstance(event, h11.Response):
                writer.close()
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} from the server")
            exchange.response = event
            return exchange

    def release(self, exchange: _Exchange | None, reusable: bool) -> None:
        if exchange is None:
            return
        if reusable and len(self._idle) < _MAX_IDLE:
            self._idle.append((exchange.reader, exchange.writer))
        else:
            exchange.writer.close()

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request, bytes] | None:
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(_READ_SIZE)
            if not data and request is None and conn.their_state is h11.IDLE:
                return None
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _json_object(body: bytes) -> dict | None:
    """The request body as a JSON object; None for anything else (the server rejects it itself)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


def _requested_names(payload: dict | None) -> list[str]:
    """Model/adapter names a request asks for: `model` and `lora_path` (a string or, for batched
    /generate, a list)."""
    names: list[str] = []
    for key in ("model", "lora_path"):
        value = (payload or {}).get(key)
        if isinstance(value, str):
            names.append(value)
        elif isinstance(value, list):
            names.extend(item for item in value if isinstance(item, str))
    return names


def _bearer(request: h11.Request) -> str | None:
    for key, value in request.headers:
        if key.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _error(message: str, code: str, param: str | None) -> dict:
    # OpenAI's error shape, so the openai client raises NotFoundError/APIStatusError with this message.
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


async def _send_json(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
    writer.write(conn.send(h11.Data(data=data)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
    await writer.drain()
