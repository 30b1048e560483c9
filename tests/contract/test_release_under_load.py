"""Releasing memory while a request runs kills SGLang 0.5.17's scheduler (it asserts it is idle), and the
server with it; the reference engine does the same, so the backend's handoff is held to it on CPU too.
Found on an H200: a watchdog health probe (SGLang's /health generates a token) met a shared-mode release."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from contract_helpers import contract_config, running_server, wait_until_dead


def test_a_release_during_a_running_request_ends_the_server(
    engine: str, model_path: str, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    with (
        running_server(contract_config(engine), model_path, engine, log) as proc,
        httpx.Client(base_url=proc.base_url, timeout=120.0, trust_env=False) as http,
    ):
        assert http.post("/release_memory_occupation", json={}).status_code == 200  # idle: accepted
        assert http.post("/resume_memory_occupation", json={}).status_code == 200
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        started = threading.Event()

        def generate() -> None:
            with httpx.Client(base_url=proc.base_url, timeout=120.0, trust_env=False) as other:
                try:
                    with other.stream("POST", "/v1/chat/completions", json=body) as stream:
                        for _ in stream.iter_lines():
                            started.set()
                except httpx.HTTPError:
                    pass  # the server is gone mid-stream

        worker = threading.Thread(target=generate)
        worker.start()
        assert started.wait(60), "the generation did not start"
        with pytest.raises(httpx.HTTPError):
            http.post("/release_memory_occupation", json={})
        worker.join(120)
        wait_until_dead(proc)
        assert "release_memory_occupation should be called only when server is idle" in proc.log_tail(400)
