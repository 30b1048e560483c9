"""`ReplicaRouter`: SGLang's router (`sglang-router`, a Rust binary behind `python -m
sglang_router.launch_router`) as a subprocess in front of several inference server replicas.

It routes each request to one replica with the cache-aware policy (the replica whose prefix cache
already holds the longest part of the prompt, unless the load is uneven; a multi-turn rollout's next
turn extends its last prompt, so it stays on its replica). Which replicas it routes to is changed at run
time through its worker API: a replica is added only once it holds every adapter being served, and
taken out before it is restarted.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from art_sglang.errors import ServerStartError
from art_sglang.process_tree import EXIT_GRACE_SECONDS, ManagedProcess, display_command, peek_exit_code
from art_sglang.serving.servers.process import claim_port, release_port

ROUTER_MODULE = "sglang_router.launch_router"
_POLL_SECONDS = 0.1
_WORKER_TIMEOUT_S = 60.0  # adding/removing a worker is queued in the router; it takes milliseconds
# The router's own health checks take a dead replica out of its rotation within about a second, before
# the backend's watchdog removes it for good.
_HEALTH_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


class ReplicaRouter(ManagedProcess):
    """The router process on `host` (free ports picked at start), run by `python`, logging to `log_path`."""

    def __init__(
        self,
        *,
        python: str | None = None,
        policy: str = "cache_aware",
        log_path: Path,
        host: str = "127.0.0.1",
        startup_timeout: float = 120.0,
    ) -> None:
        super().__init__("SGLang router", log_path)
        self.python = python or sys.executable
        self.policy = policy
        self.host = host
        self.startup_timeout = startup_timeout
        self._ports: tuple[int, int] | None = None  # (routing, Prometheus metrics)

    @property
    def base_url(self) -> str:
        if self._ports is None:
            raise RuntimeError("the router's port is chosen when it starts; call start() first")
        return f"http://{self.host}:{self._ports[0]}"

    def command(self) -> list[str]:
        assert self._ports is not None
        port, metrics_port = self._ports
        return [
            self.python, "-m", ROUTER_MODULE,
            "--host", self.host, "--port", str(port),
            "--policy", self.policy,
            # Its metrics server listens on a fixed port unless told otherwise; two routers would clash.
            "--prometheus-host", self.host, "--prometheus-port", str(metrics_port),
            "--log-level", "warn",
            *_HEALTH_FLAGS,
        ]  # fmt: skip

    async def start(self) -> None:
        """Launch the router (with no worker) and wait until it answers `GET /health`; `ServerStartError`
        with its log tail if it exits first or does not answer within `startup_timeout`."""
        if self.is_alive():
            return
        if self._popen is not None:
            await self.stop()
        self._ports = (claim_port(self.host, None), claim_port(self.host, None))
        command = self.command()
        try:
            popen = self._launch(command, {**os.environ, "PYTHONUNBUFFERED": "1"}, pipes=False)
        except OSError as exc:
            self._release_ports()
            raise ServerStartError(f"Could not run {display_command(command)}: {exc}") from exc
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
            while True:
                code = peek_exit_code(popen)
                problem = f"exited with code {code}" if code is not None else None
                if problem is None and time.monotonic() > deadline:
                    problem = f"did not answer within {self.startup_timeout:g} s"
                if problem is not None:
                    await self.stop()
                    raise ServerStartError(
                        f"SGLang's router {problem} (is sglang-router installed for {self.python}?).\n"
                        f"command: {display_command(command)}\nlog: {self.log_path}\n"
                        f"--- last lines of the log ---\n{self.log_tail()}"
                    )
                try:
                    if (await http.get(f"{self.base_url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(_POLL_SECONDS)

    async def stop(self, timeout: float = EXIT_GRACE_SECONDS) -> None:
        """Stop the router's process tree. Idempotent."""
        if await self._terminate(timeout) is not None:
            self._release_ports()

    def _release_ports(self) -> None:
        for port in self._ports or ():
            release_port(port)

    # --- the replicas it routes to ---------------------------------------------------------------------
    async def workers(self) -> dict[str, bool]:
        """The replicas the router routes to: URL -> whether its health checks pass."""
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
            response = await http.get(f"{self.base_url}/workers")
        response.raise_for_status()
        return {w["url"]: bool(w.get("is_healthy")) for w in response.json().get("workers", [])}

    async def add_worker(self, url: str, api_key: str | None = None) -> None:
        """Route to the replica at `url` from now on (sending it `api_key`, if given, instead of the
        client's); returns once the router lists it as healthy."""
        worker = {"url": url} if api_key is None else {"url": url, "api_key": api_key}
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
            response = await http.post(f"{self.base_url}/workers", json=worker)
        self._check(response, f"adding replica {url}")
        await self._wait_until(lambda workers: workers.get(url) is True, f"list replica {url} as healthy")

    async def remove_worker(self, url: str) -> None:
        """Stop routing to the replica at `url`; returns once the router no longer lists it. A router that
        is not running routes to nothing, so there is nothing to do."""
        if not self.is_alive():
            return
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
            listing = (await http.get(f"{self.base_url}/workers")).json().get("workers", [])
            for worker in listing:
                if worker["url"] == url:
                    self._check(
                        await http.delete(f"{self.base_url}/workers/{worker['id']}"), f"removing {url}"
                    )
        await self._wait_until(lambda workers: url not in workers, f"drop replica {url}")

    def _check(self, response: httpx.Response, what: str) -> None:
        if response.status_code >= 400:
            raise ServerStartError(
                f"SGLang's router refused {what}: HTTP {response.status_code} {response.text}"
            )

    async def _wait_until(self, done: Callable[[dict[str, bool]], bool], what: str) -> None:
        deadline = time.monotonic() + _WORKER_TIMEOUT_S
        while not done(await self.workers()):
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"SGLang's router did not {what} within {_WORKER_TIMEOUT_S:g} s; log: {self.log_path}\n"
                    f"--- last lines of the log ---\n{self.log_tail()}"
                )
            await asyncio.sleep(_POLL_SECONDS)
