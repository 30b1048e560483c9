"""ServerProcess against real subprocesses: the reference engine, and small `python -c` servers where a
test needs a behaviour no real engine shows on demand (exits at once, never healthy, ignores SIGTERM)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from art_sglang.config import SGLangConfig
from art_sglang.errors import ServerStartError
from art_sglang.serving.servers import process as process_module
from art_sglang.serving.servers.client import ServerClient
from art_sglang.serving.servers.process import ServerProcess
from art_sglang.sglang_env import SGLANG_ENV_DEFAULTS

# A minimal HTTP server: GET /health -> 200 once it is up. It writes its environment to the log and says
# when SIGTERM arrives; with `--stubborn` it ignores SIGTERM and first starts a grandchild that ignores
# SIGTERM too.
HEALTH_SERVER = textwrap.dedent(
    """
    import http.server, json, os, signal, subprocess, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    wanted = ("CUDA_VISIBLE_DEVICES", "EXTRA", "SGL")
    print("ENV " + json.dumps({k: v for k, v in sorted(os.environ.items()) if k.startswith(wanted)}))
    if "--config" in args:
        keys = args[args.index("--config") + 1]
        print("CONFIG", oct(os.stat(keys).st_mode & 0o777), ",".join(sorted(json.load(open(keys)))))
    def on_sigterm(*_):
        print("SIGTERM received", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    if "--stubborn" in args:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(
            [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
             "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


class ScriptServer(ServerProcess):
    """A ServerProcess whose command runs `script` with the usual server flags (plus `extra`)."""

    def __init__(
        self,
        script: str,
        tmp_path: Path,
        *,
        extra: tuple[str, ...] = (),
        admin_api_key: str | None = None,
        **config: object,
    ):
        super().__init__(
            SGLangConfig(**config),
            "unused-model",
            engine="reference",
            log_path=tmp_path / "logs" / "server.log",
            admin_api_key=admin_api_key,
        )
        self.script = script
        self.extra = extra

    def command(self) -> list[str]:
        python_and_module = 3
        return [sys.executable, "-c", self.script, *super().command()[python_and_module:], *self.extra]


def tree_pids(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [pid, *(p.pid for p in root.children(recursive=True))]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def healthy(url: str) -> bool:
    async with httpx.AsyncClient(trust_env=False) as http:
        return (await http.get(f"{url}/health")).status_code == 200


def test_command_per_engine(tmp_path: Path) -> None:
    config = SGLangConfig(port=31234, server_python="/opt/sglang-venv/bin/python")
    sglang = ServerProcess(config, "/models/m", engine="sglang", log_path=tmp_path / "s.log")
    reference = ServerProcess(config, "/models/m", engine="reference", log_path=tmp_path / "r.log")
    args = config.server_args("/models/m", 31234)
    assert sglang.command() == ["/opt/sglang-venv/bin/python", "-m", "sglang.launch_server", *args]
    assert reference.command() == [sys.executable, "-m", "art_sglang_reference", *args]
    assert sglang.base_url == "http://127.0.0.1:31234"


async def test_exit_at_once_fails_fast_with_command_and_log_tail(tmp_path: Path) -> None:
    server = ScriptServer("print('no such model: bogus'); raise SystemExit(3)", tmp_path, server_timeout=60)
    began = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        await server.start()
    assert time.monotonic() - began < 10
    message = str(info.value)
    assert "exited with code 3" in message
    assert "no such model: bogus" in message
    assert "--model-path unused-model" in message
    assert not server.is_alive()


async def test_missing_server_python(tmp_path: Path) -> None:
    config = SGLangConfig(server_python=str(tmp_path / "no-venv" / "bin" / "python"))
    server = ServerProcess(config, "m", engine="sglang", log_path=tmp_path / "s.log")
    with pytest.raises(ServerStartError, match=r"Could not run .*no-venv/bin/python -m sglang.launch_server"):
        await server.start()
    assert server.pid is None


async def test_never_healthy_times_out_and_is_killed(tmp_path: Path, monkeypatch, caplog) -> None:
    script = "import time; print('loading weights...', flush=True); time.sleep(600)"
    server = ScriptServer(script, tmp_path, server_timeout=1.5)
    monkeypatch.setattr(process_module, "_REPORT_SECONDS", 0.5)
    with (
        caplog.at_level(logging.INFO, logger=process_module.__name__),
        pytest.raises(ServerStartError, match=r"not healthy within 1.5 s(.|\n)*loading weights"),
    ):
        await server.start()
    assert server.pid is None
    assert not server.is_alive()
    # The wait is reported in whole log lines (a redrawn counter ran into other components' lines).
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith(f"starting the {server.label} on port {server.port} (log: {server.log_path})")
    assert any(f"the {server.label} is still starting" in line for line in lines[1:]), lines


async def test_stop_kills_whole_tree_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    server = ScriptServer(HEALTH_SERVER, tmp_path, extra=("--stubborn",))
    await server.start()
    assert server.pid is not None
    pids = tree_pids(server.pid)
    assert len(pids) == 2  # the server and its SIGTERM-ignoring grandchild
    began = time.monotonic()
    await server.stop(timeout=1.0)
    assert time.monotonic() - began < 5
    assert not [pid for pid in pids if running(pid)]
    await server.stop()  # idempotent
    assert not server.is_alive()


async def test_environment_and_log_header(tmp_path: Path) -> None:
    server = ScriptServer(
        HEALTH_SERVER, tmp_path, server_env={"EXTRA": "1"}, api_key="s3cret", admin_api_key="4dmin"
    )
    server.gpu_ids = [2, 3]
    await server.start()
    assert not server.keys_file.exists()  # read by the server at its start, deleted once it is up
    await server.stop()
    log = server.log_path.read_text()
    assert log.startswith("=== ")
    # The keys reach the server in a file only this user can read, never on its command line.
    assert f"--config {server.keys_file}" in log and "--api-key" not in log
    assert "CONFIG 0o600 admin-api-key,api-key" in log
    assert server.log_path.stat().st_mode & 0o777 == 0o600  # SGLang logs its arguments, keys included
    assert "s3cret" not in log and "4dmin" not in log
    assert '"CUDA_VISIBLE_DEVICES": "2,3"' in log
    assert '"EXTRA": "1"' in log
    name, value = next(iter(SGLANG_ENV_DEFAULTS.items()))
    assert f'"{name}": "{value}"' in log


async def test_concurrent_servers_get_different_ports(tmp_path: Path) -> None:
    servers = [ScriptServer(HEALTH_SERVER, tmp_path / str(i)) for i in range(3)]
    try:
        await asyncio.gather(*(s.start() for s in servers))
        assert len({s.port for s in servers}) == 3
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        assert all(s.port < ephemeral_low for s in servers)  # outgoing connections cannot take them
        for server in servers:
            assert await healthy(server.base_url)
    finally:
        await asyncio.gather(*(s.stop() for s in servers))


async def test_killed_server_is_detected_and_starts_again(tmp_path: Path) -> None:
    server = ScriptServer(HEALTH_SERVER, tmp_path, extra=("--stubborn",))
    await server.start()
    assert server.is_alive() and server.pid is not None
    crashed, orphan = tree_pids(server.pid)
    port = server.port
    os.kill(crashed, signal.SIGKILL)
    for _ in range(100):
        if not server.is_alive():
            break
        await asyncio.sleep(0.05)
    assert not server.is_alive()
    assert re.search(r"exit code -9(.|\n)*last lines of the log(.|\n)*ENV", server.describe_death("died"))
    # Not reaped yet, so its pid and process group cannot go to another process before the cleanup.
    assert psutil.Process(crashed).status() == psutil.STATUS_ZOMBIE
    assert running(orphan)  # SIGKILL spared the grandchild; a new start clears it away
    try:
        await server.start()
        assert not running(orphan)
        assert server.port == port
        assert await healthy(server.base_url)
    finally:
        await server.stop(timeout=0.5)
    assert not server.is_alive()


def test_server_dies_with_its_user(tmp_path: Path) -> None:
    """A script starts a server and exits without stop() (atexit), or is SIGKILLed (parent-death signal)."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_server_process import ScriptServer, HEALTH_SERVER
        server = ScriptServer(HEALTH_SERVER, Path({str(tmp_path)!r}))
        asyncio.run(server.start())
        print(server.pid, flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
        """
    )
    for how in ("exit", "hang"):
        user = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True)
        try:
            pid = int(user.stdout.readline())
            assert running(pid)
            if how == "hang":
                user.kill()
            assert user.wait(timeout=30) == (0 if how == "exit" else -9)
            deadline = time.monotonic() + 10
            while running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not running(pid), how
            # At exit the server is stopped gracefully (atexit); a SIGKILLed user's server gets SIGKILL.
            graceful = (tmp_path / "logs" / "server.log").read_text().splitlines().count("SIGTERM received")
            assert graceful == 1, how
        finally:
            user.kill()
            user.wait()


async def test_reference_engine_bad_model_path(tmp_path: Path) -> None:
    config = SGLangConfig(server_timeout=120)
    server = ServerProcess(
        config, str(tmp_path / "no-model"), engine="reference", log_path=tmp_path / "s.log"
    )
    with pytest.raises(ServerStartError, match=r"exited with code [1-9](.|\n)*last lines of the log") as info:
        await server.start()
    message = str(info.value)
    assert f"-m art_sglang_reference --model-path {tmp_path / 'no-model'}" in message
    assert message.count("\n") > 4  # the log tail, not just the headline
    assert not server.is_alive()


async def test_reference_engine_restart_is_healthy_on_the_same_port(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    config = SGLangConfig(server_timeout=120)
    server = ServerProcess(config, str(tiny_model_path), engine="reference", log_path=tmp_path / "s.log")
    await server.start()
    try:
        first_pid, port = server.pid, server.port
        await server.stop()
        await server.start()
        assert server.pid != first_pid
        assert not running(first_pid)
        assert server.port == port
        assert await healthy(server.base_url)
        async with ServerClient(server.base_url) as client:
            assert [card.id for card in await client.list_models()] == [str(tiny_model_path)]
    finally:
        await server.stop()


def test_sglang_finds_the_backports_plugin_on_its_path(tmp_path: Path) -> None:
    """SGLang's plugin loader reads `importlib.metadata.entry_points(group="sglang.srt.plugins")`: a python
    with the server's environment finds the backports there and loads their `register`."""
    their_path = "/somewhere/else"
    server = ServerProcess(
        SGLangConfig(server_env={"PYTHONPATH": their_path}),
        "m",
        engine="sglang",
        log_path=tmp_path / "s.log",
    )
    env = server.environment()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(process_module.SGLANG_SITE), their_path]
    script = (
        "from importlib.metadata import entry_points\n"
        "[ep] = [ep for ep in entry_points(group='sglang.srt.plugins') if ep.dist.name == 'art-sglang-backports']\n"
        "print(ep.name, ep.load().__module__)\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert found.stdout.split() == ["art_sglang_backports", "art_sglang_backports"]
    reference = ServerProcess(SGLangConfig(), "m", engine="reference", log_path=tmp_path / "r.log")
    assert str(process_module.SGLANG_SITE) not in reference.environment().get("PYTHONPATH", "")


async def test_a_backport_of_no_name_fails_before_the_launch(tmp_path: Path) -> None:
    config = SGLangConfig(
        server_python=sys.executable, server_env={"ART_SGLANG_BACKPORTS": "json-response,fast"}
    )
    server = ServerProcess(config, "m", engine="sglang", log_path=tmp_path / "s.log")
    with pytest.raises(ValueError, match=r"names no backport \['fast'\].*gumbel-sampling.*json-response"):
        await server.start()
    assert server.pid is None and not server.log_path.exists()


@pytest.mark.parametrize(
    ("raw", "chosen"),
    [(None, ["json-response", "gumbel-sampling", "chat-template-memo", "chat-convert-thread", "csgmv-decode-grid",
             "triton-prefill-grid", "evict-without-gc", "evict-ahead", "logprob-json"]),
     ("default", ["json-response", "gumbel-sampling", "chat-template-memo", "chat-convert-thread", "csgmv-decode-grid",
                  "triton-prefill-grid", "evict-without-gc", "evict-ahead", "logprob-json"]),
     ("all", ["json-response", "gumbel-sampling", "chat-template-memo", "chat-convert-thread", "csgmv-decode-grid",
              "triton-prefill-grid", "evict-without-gc", "evict-ahead", "logprob-json"]),
     ("none", []), (" gumbel-sampling , ", ["gumbel-sampling"]), ("csgmv-decode-grid", ["csgmv-decode-grid"]),
     ("triton-prefill-grid", ["triton-prefill-grid"]), ("evict-without-gc", ["evict-without-gc"]),
     ("evict-ahead,evict-without-gc", ["evict-ahead", "evict-without-gc"])],
)  # fmt: skip
def test_backport_selection(raw: str | None, chosen: list[str]) -> None:
    assert process_module.backports.selection(raw) == chosen


def test_all_default_backports_but_one() -> None:
    everyone = process_module.backports.selection(None)
    for name in everyone:
        assert process_module.backports.selection(process_module.backports.without(name)) == [
            other for other in everyone if other != name
        ]
    assert process_module.backports.without("json-response").split(",")[0] == "gumbel-sampling"
    assert process_module.backports.selection(
        process_module.backports.without("evict-without-gc, evict-ahead")
    ) == [name for name in everyone if not name.startswith("evict-")]


@pytest.mark.parametrize(
    ("version", "numbers"), [("0.5.17", (0, 5, 17)), ("0.5.17.post1", (0, 5, 17)), ("0.5.23rc0", (0, 5, 23)),
                             ("1.0", (1, 0, 0))]
)  # fmt: skip
def test_backports_read_the_release(version: str, numbers: tuple[int, int, int]) -> None:
    assert process_module.backports.release(version) == numbers
