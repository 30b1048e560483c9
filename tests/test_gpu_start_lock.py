"""Replicas Ray places on one GPU start one after the other (`cluster.host.one_start_per_gpu`): SGLang sizes
its memory from what is free when it starts, so two starting together on one GPU can leave the second no
room for its KV cache. Starts on other GPUs, or without a GPU, do not wait."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")
from art_sglang.cluster.host import one_start_per_gpu

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def _lock_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The locks live in the temporary folder; the test's own, so none is left behind.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


async def _start(gpus: str | None, log: list[str], name: str, hold: float = 0.2) -> None:
    async with one_start_per_gpu(gpus):
        log.append(f"{name} in")
        await asyncio.sleep(hold)
        log.append(f"{name} out")


async def test_starts_on_one_gpu_take_turns() -> None:
    log: list[str] = []
    await asyncio.gather(_start("7", log, "a"), _start("7", log, "b"))
    assert log in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])


@pytest.mark.parametrize("other", ["8", None], ids=["another GPU", "no GPU"])
async def test_other_starts_do_not_wait(other: str | None) -> None:
    log: list[str] = []
    await asyncio.gather(_start("7", log, "a"), _start(other, log, "b"))
    assert log[:2] in (["a in", "b in"], ["b in", "a in"])


async def test_a_start_that_fails_lets_the_next_one_go() -> None:
    with pytest.raises(RuntimeError):
        async with one_start_per_gpu("7"):
            raise RuntimeError("the server did not start")
    log: list[str] = []
    await asyncio.wait_for(_start("7", log, "next", hold=0), 5)
    assert log == ["next in", "next out"]
