"""`CudaMps`'s process handling, with a stand-in for NVIDIA's control program (the real one needs a GPU
and runs in tests/gpu/test_cuda_mps.py): it waits for the control socket, hides CUDA_VISIBLE_DEVICES from
the daemon, asks it to quit on stop and clears its directory, and a daemon that fails to start is a
ConfigError with its log (with cuda_mps="auto" the backend warns and goes on without)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from art_sglang import ConfigError
from art_sglang.cuda_mps import CudaMps, start_daemon

# -f: make the control socket, note the environment, run until asked to quit; otherwise: a `quit` on
# stdin is passed to the running daemon.
STAND_IN = """#!/bin/sh
if [ "$1" = "-f" ]; then
  echo "visible=${CUDA_VISIBLE_DEVICES-unset}" >> "$RECORD"
  sleep 0.3; touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  while [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/quit" ]; do sleep 0.05; done
  echo "quit taken" >> "$RECORD"; exit 0
fi
read command; [ "$command" = quit ] && touch "$CUDA_MPS_PIPE_DIRECTORY/quit"
"""
BROKEN = "#!/bin/sh\necho 'An MPS control daemon is already running' >&2\nexit 1\n"


def stand_in(directory: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    program = directory / "nvidia-cuda-mps-control"
    program.write_text(text)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{directory}:/usr/bin:/bin")
    record = directory / "record"
    monkeypatch.setenv("RECORD", str(record))
    return record


async def test_start_waits_for_the_socket_and_stop_quits_and_cleans_up(tmp_path, monkeypatch):
    record = stand_in(tmp_path, STAND_IN, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    daemon = CudaMps(tmp_path / "logs" / "cuda-mps.log")
    env = await daemon.start()
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "control").exists() and daemon.is_alive()
    assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert len(str(pipe / "control")) < 108  # a Unix socket's path limit
    pid = daemon.pid
    assert pid is not None
    await daemon.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not pipe.parent.exists()
    assert record.read_text().splitlines() == ["visible=unset", "quit taken"]
    await daemon.stop()  # idempotent


async def test_a_daemon_that_does_not_start_is_a_config_error_with_its_log(tmp_path, monkeypatch):
    stand_in(tmp_path, BROKEN, monkeypatch)
    daemon = CudaMps(tmp_path / "cuda-mps.log")
    before = set(Path(tempfile.gettempdir()).glob("art-sglang-mps-*"))
    with pytest.raises(ConfigError, match=r"(?s)CUDA MPS could not start.*already running.*cuda_mps='off'"):
        await daemon.start()
    assert not daemon.is_alive()
    assert set(Path(tempfile.gettempdir()).glob("art-sglang-mps-*")) == before  # its directory removed


async def test_a_failed_daemon_is_a_warning_with_auto_and_an_error_with_on(tmp_path, monkeypatch, caplog):
    stand_in(tmp_path, BROKEN, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="art_sglang.cuda_mps"):
        assert await start_daemon("auto", tmp_path / "auto.log") is None
    assert "Going on without CUDA MPS" in caplog.text and "already running" in caplog.text
    with pytest.raises(ConfigError, match="CUDA MPS could not start"):
        await start_daemon("on", tmp_path / "on.log")


OWNER = """
import asyncio, sys
from pathlib import Path
from art_sglang.cuda_mps import CudaMps, start_daemon

async def main():
    daemon = CudaMps(Path(sys.argv[1]))  # held: the handle kills its daemon when collected
    print((await daemon.start())["CUDA_MPS_PIPE_DIRECTORY"], flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_killed_backends_daemon_dies_with_it_and_the_next_start_removes_its_directory(
    tmp_path, monkeypatch
):
    stand_in(tmp_path, STAND_IN, monkeypatch)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "owner.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        left = Path(owner.stdout.readline().strip()).parent
        daemon = psutil.Process(owner.pid).children()[0]
    finally:
        owner.kill()
        owner.wait()
    daemon.wait(timeout=5)  # the parent-death signal
    assert left.is_dir()
    live = Path(tempfile.mkdtemp(prefix=f"art-sglang-mps-{os.getpid()}-"))  # another backend's, running
    try:
        next_daemon = CudaMps(tmp_path / "next.log")
        await next_daemon.start()
        await next_daemon.stop()
        assert not left.exists() and live.is_dir()
    finally:
        live.rmdir()
