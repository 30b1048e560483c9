"""`ServerProcess`: one inference server (SGLang or the reference engine) as a subprocess — launch, wait
until healthy, stop its whole process tree, restart, and notice when it died.

Its keys (`--api-key`, `--admin-api-key`) never appear on its command line, which every local user can
read (`ps`): they are written to a file only this user can read, passed as SGLang's `--config <file>`, and
the file is deleted once the server is up (SGLang reads it while parsing its arguments).

SGLang runs with `sglang_site/` first on its PYTHONPATH: the plugin there backports fixes from newer SGLang
releases (`sglang_site/art_sglang_backports.py`; `ART_SGLANG_BACKPORTS` chooses them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import httpx

from art_sglang.config import SGLangConfig
from art_sglang.errors import ServerStartError
from art_sglang.process_tree import EXIT_GRACE_SECONDS, ManagedProcess, display_command, peek_exit_code
from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports
from art_sglang.sglang_env import EXPERIMENTAL_LORA_ENV, KEEP_ALIVE_ENV, SGLANG_ENV_DEFAULTS

Engine = Literal["sglang", "reference"]

ENGINE_MODULES: dict[Engine, str] = {
    "sglang": "sglang.launch_server",
    "reference": "art_sglang_reference",
}
logger = logging.getLogger(__name__)
# Only the plugin and its dist-info are in this folder, so the server's own packages are never shadowed.
SGLANG_SITE = Path(__file__).resolve().parent / "sglang_site"

_POLL_SECONDS = 0.25
_REPORT_SECONDS = 30.0  # between "still starting" lines

# Ports handed to servers of this interpreter and not released yet, so that servers started at the same
# time never get the same "free" port before either has bound it.
_reserved_ports: set[int] = set()
_ports_lock = threading.Lock()


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # Same option as the servers use, so a port in TIME_WAIT from a previous run counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def claim_port(host: str, wanted: int | None) -> int:
    """Reserve `wanted` if it is free and unreserved, else a random free port.

    The port is chosen below the OS's ephemeral range: the server binds it only after loading the model
    (minutes for SGLang), and meanwhile any outgoing connection could take an ephemeral port as its own.
    """
    low = 10000
    high = _ephemeral_range()[0] - 1
    if high - low < 1000:  # an unusual range: any port not reserved and free will do
        low, high = 1024, 65535
    with _ports_lock:
        candidates = [wanted] if wanted is not None else []
        candidates += [random.randint(low, high) for _ in range(200)]
        for port in candidates:
            if port not in _reserved_ports and _port_is_free(host, port):
                _reserved_ports.add(port)
                return port
    raise ServerStartError(f"found no free port on {host} in {low}-{high}")


def release_port(port: int) -> None:
    with _ports_lock:
        _reserved_ports.discard(port)


def _connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class ServerProcess(ManagedProcess):
    """An inference server subprocess in its own session, logging to `log_path` (see `ManagedProcess` for
    when its tree is killed)."""

    def __init__(
        self,
        config: SGLangConfig,
        model_path: str,
        *,
        engine: Engine,
        log_path: Path,
        gpu_ids: Sequence[int | str] | None = None,
        admin_api_key: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`config.api_key` is the key of the server's ordinary routes, `admin_api_key` that of its admin
        routes (None: the ordinary key opens them too, as in SGLang). `env`: added to its environment."""
        super().__init__(f"{engine} server", log_path)
        self.config = config
        self.admin_api_key = admin_api_key
        self.model_path = model_path
        self.engine: Engine = engine
        self.gpu_ids = gpu_ids
        self._extra_env = dict(env or {})
        self._port: int | None = config.port

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the port is chosen when the server starts; call start() first")
        return self._port

    @property
    def base_url(self) -> str:
        """`http://<host>:<port>` without `/v1`."""
        return f"http://{_connect_host(self.config.host)}:{self.port}"

    @property
    def keys_file(self) -> Path:
        """Where the keys are written for a start (deleted again once the server is up)."""
        return self.log_path.with_name(f".{self.log_path.stem}-keys-{self.port}.yaml")

    def _keys(self) -> dict[str, str]:
        keys = {"api-key": self.config.api_key, "admin-api-key": self.admin_api_key}
        return {flag: key for flag, key in keys.items() if key is not None}

    def command(self) -> list[str]:
        """The launch command; SGLang runs under the server venv's python, the reference engine under ours."""
        python = self.config.resolved_server_python() if self.engine == "sglang" else sys.executable
        keys = ["--config", str(self.keys_file)] if self._keys() else []
        return [
            python,
            "-m",
            ENGINE_MODULES[self.engine],
            *self.config.server_args(self.model_path, self.port),
            *keys,
        ]

    def _write_keys(self) -> None:
        """The keys file, readable by this user only (JSON, which SGLang's YAML reader reads too)."""
        self.keys_file.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.keys_file.unlink()  # created anew below, so the mode applies
        fd = os.open(self.keys_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._keys(), f)

    def environment(self) -> dict[str, str]:
        lora_env = EXPERIMENTAL_LORA_ENV if self.config.experimental_lora_served else {}
        env = {**os.environ, **SGLANG_ENV_DEFAULTS, **lora_env, **self.config.server_env, **self._extra_env}
        # Log lines reach the file as they are written, so a failed start shows its last words.
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        if self.engine == "sglang":
            backports.selection(env.get(backports.SELECT_ENV))  # a bad name fails here, not in the server
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SGLANG_SITE), env.get("PYTHONPATH")]))
        return env

    @property
    def keep_alive(self) -> float:
        """Seconds the server keeps an idle connection open (its `SGLANG_TIMEOUT_KEEP_ALIVE`)."""
        return float(self.environment()[KEEP_ALIVE_ENV])

    async def start(self) -> None:
        """Launch the server and wait until `GET /health` answers 200.

        Raises `ServerStartError` (with the command and the log tail) if the process exits first or is not
        healthy within `config.server_timeout` seconds; the process tree is killed in both cases.
        """
        if self.is_alive():
            return
        if self._popen is not None:
            # It crashed: clear what is left of its tree (and its exit hook) first.
            await self.stop(timeout=EXIT_GRACE_SECONDS)
        environment = self.environment()
        self._port = self.config.port or claim_port(self.config.host, self._port)
        command = self.command()
        if self._keys():
            self._write_keys()
        try:
            # Popen runs on the event loop's thread on purpose: the parent-death signal is tied to the
            # forking thread, and an executor thread may exit while the server still runs.
            try:
                self._launch(command, environment, pipes=False)
            except OSError as exc:  # e.g. the server venv's python does not exist
                self._release_auto_port()
                raise ServerStartError(f"Could not run {display_command(command)}: {exc}") from exc
            try:
                await self._wait_healthy(command)
            except BaseException:
                # Timeout, early exit, or the caller gave up (cancellation, Ctrl-C): never leave it running.
                await self.stop(timeout=EXIT_GRACE_SECONDS)
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.keys_file.unlink()

    async def _wait_healthy(self, command: list[str]) -> None:
        assert self._popen is not None
        timeout = self.config.server_timeout
        url = f"{self.base_url}/health"  # open without a key
        began = time.monotonic()
        # Log lines, not a live counter: other components log while a server starts (the trainer does), and
        # a counter redrawn on stderr ran into their lines.
        logger.info("starting the %s on port %d (log: %s), waiting up to %g s", self.label, self.port,
                    self.log_path, timeout)  # fmt: skip
        reported = began
        # trust_env=False: a proxy from the environment must not intercept a local server.
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
            while True:
                code = peek_exit_code(self._popen)
                if code is not None:
                    raise ServerStartError(self._start_failure(command, f"exited with code {code}"))
                try:
                    if (await http.get(url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                now = time.monotonic()
                if now - began >= timeout:
                    raise ServerStartError(
                        self._start_failure(command, f"was not healthy within {timeout:g} s")
                    )
                if now - reported >= _REPORT_SECONDS:
                    reported = now
                    logger.info("the %s is still starting (%.0f of %g s)", self.label, now - began, timeout)
                await asyncio.sleep(_POLL_SECONDS)

    def _start_failure(self, command: list[str], what: str) -> str:
        return (
            f"The {self.engine} server {what} (port {self.port}).\n"
            f"command: {display_command(command)}\n"
            f"log: {self.log_path}\n--- last lines of the log ---\n{self.log_tail()}"
        )

    async def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL every process of its tree still alive after
        `timeout` seconds. Idempotent; fine if the server already died."""
        if await self._terminate(timeout) is not None:
            self._release_auto_port()  # a restart claims it again if it is still free

    def _release_auto_port(self) -> None:
        if self.config.port is None and self._port is not None:
            release_port(self._port)
