"""The train() step path checks only that the server process lives; health probes are the watchdog's. On
SGLang 0.5.17 `GET /health` generates a token and answers after a second, so a probe on the step path cost
each step about a second (measured on an H200), and a probe in flight at a memory release kills the server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from art_sglang.config import SGLangConfig, TrainerConfig
from art_sglang.planning.devices import detect_gpus
from art_sglang.planning.make_plan import make_plan
from art_sglang.planning.request import BackendRequest
from art_sglang.serving.adapters import InferenceService


async def _health_lines(log: Path, at_least: int) -> int:
    """The `GET /health` lines of the server log, once there are `at_least` (a server writes a request's
    line after answering it), or what there is after 30 s."""
    for _ in range(300):
        count = log.read_text().count("GET /health")
        if count >= at_least:
            return count
        await asyncio.sleep(0.1)
    return count


async def test_the_step_path_only_looks_for_a_dead_server(tiny_model_path: Path, tmp_path: Path) -> None:
    plan = make_plan(BackendRequest(SGLangConfig(), TrainerConfig(), engine="reference"), None, detect_gpus())
    service = InferenceService(plan, str(tiny_model_path), log_path=tmp_path / "server.log")
    servers = service.servers
    try:
        await servers.start()
        log = service.process.log_path
        before = await _health_lines(log, 0)
        assert await servers.recover(probe=False) is False
        assert await servers.recover() is False  # the watchdog's call: one probe, answered
        assert await _health_lines(log, before + 1) == before + 1  # ... and none from the step path's call
        dead = service.process.pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        for _ in range(100):
            if not service.process.is_alive():
                break
            await asyncio.sleep(0.1)
        assert await servers.recover(probe=False) is True  # a dead server is restarted without a probe
        assert service.process.pid not in (None, dead) and service.process.is_alive()
    finally:
        await service.close()
