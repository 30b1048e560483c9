"""Integrity of runs on disk and of served names, with real processes (one backend, checked in order):
failed registrations leave the backend usable, one live backend per model directory, one model per served
name, names SGLang can parse, over-long requests refused before they are tokenized, trainer logs without
runpy's warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from backend_helpers import REPO, bearer

import art_sglang as art
from art_sglang import ConfigError, SGLangBackend
from art_sglang.storage.run_lock import RunLock


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


async def test_registration_integrity(tmp_path: Path, tiny_model_path: Path, openpipe_art) -> None:
    path = tmp_path / ".art"
    model = art.TrainableModel(name="agent", project="one", base_model=str(tiny_model_path))
    async with SGLangBackend(path=str(path)) as backend:
        # Failed registrations first: a missing path is named as such, and a broken model that fails to
        # load leaves no server bound to its base model, so the good model registers after them.
        missing = art.TrainableModel(name="m1", project="p", base_model=str(tmp_path / "no-such-model"))
        with pytest.raises(ConfigError, match="does not exist"):
            await missing.register(backend)
        # A directory that is no model (say /etc) or a file is named as such, with what a model holds.
        not_a_model = tmp_path / "etc"
        not_a_model.mkdir()
        (not_a_model / "hosts").write_text("127.0.0.1 localhost\n")
        for base, problem in [
            (not_a_model, "is not a model directory: it has no config.json"),
            (not_a_model / "hosts", "is a file, not a model directory"),
        ]:
            wrong = art.TrainableModel(name="m0", project="p", base_model=str(base))
            with pytest.raises(ConfigError, match=problem):
                await wrong.register(backend)
        broken_dir = tmp_path / "broken-model"
        broken_dir.mkdir()
        (broken_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        broken = art.TrainableModel(name="m2", project="p", base_model=str(broken_dir))
        with pytest.raises(art.ArtSGLangError):
            await broken.register(backend)
        assert backend.inference is None
        await model.register(backend)
        assert await model.get_step() == 0

        # A second backend on the same model directory, in another process, is refused at once.
        second = _run(
            f"""
            import asyncio, art_sglang as art
            async def main():
                backend = art.SGLangBackend(path={str(path)!r})
                model = art.TrainableModel(name="agent", project="one", base_model={str(tiny_model_path)!r})
                try:
                    await model.register(backend)
                finally:
                    await backend.close()
            asyncio.run(main())
            """
        )
        assert second.returncode != 0
        assert f"in use by another backend (pid {os.getpid()} " in second.stderr

        # The same name in another project would be served as the same agent@N: refused.
        other = art.TrainableModel(name="agent", project="two", base_model=str(tiny_model_path))
        with pytest.raises(ConfigError, match="already registered on this backend"):
            await other.register(backend)
        assert not (path / "two").exists()

        # Names SGLang would read as <base>:<adapter>, or with control characters, are refused before anything.
        ART = openpipe_art
        for bad in ("a:b", "a\x00b"):
            with pytest.raises(ConfigError, match="cannot be used"):
                await ART.TrainableModel(name=bad, project="one", base_model=str(tiny_model_path)).register(
                    backend
                )

        # A message that cannot fit the context is refused before it is tokenized.
        huge = {
            "model": "agent@0",
            "messages": [{"role": "user", "content": "x" * 50_000_000}],
            "max_tokens": 1,
        }
        server = backend.inference.process
        async with httpx.AsyncClient(
            timeout=120, trust_env=False, headers=bearer(server.config.api_key)
        ) as http:
            response = await http.post(f"{server.base_url}/v1/chat/completions", json=huge)
        assert response.status_code == 400 and "at least" in response.json()["message"]

        # The trainer's log starts without runpy's warning about the worker module.
        log = (path / "one" / "models" / "agent" / "logs" / "trainer.log").read_text()
        assert "RuntimeWarning" not in log and "found in sys.modules" not in log

    # Closed: the directory is free again.
    lock = RunLock(path / "one" / "models" / "agent")
    lock.acquire()
    lock.release()


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from art_sglang.storage.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # SIGKILL left no stale lock
    lock.release()
