"""Shared fixtures: the offline tiny model and its tokenizer, and a guard that no test leaves a child
process running."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from art_sglang.tiny_model import build_tiny_model


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine",
        default="reference",
        choices=["reference", "sglang"],
        help="Inference engine the contract tests start (sglang needs a GPU and the server venv).",
    )
    parser.addoption("--model-path", default=None, help="Model for the contract tests (default: tiny model).")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("ART_SGLANG_TINY_MODEL")
    if cache:
        return build_tiny_model(cache)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def openpipe_art(monkeypatch: pytest.MonkeyPatch):
    """The real `art` package (openpipe-art), imported without leaving its side effects on this process.

    Importing `art` replaces `transformers.masking_utils._preprocess_mask_arguments` with a wrapper whose
    signature no longer matches transformers 5.2x, which breaks every later forward pass in this process;
    the original is put back after the test. (Our trainer runs in its own process, so ART programs are not
    affected.)
    """
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # ART's import would go to the network
    from transformers import masking_utils

    original = masking_utils._preprocess_mask_arguments
    import art

    try:
        yield art
    finally:
        masking_utils._preprocess_mask_arguments = original


def _is_resource_tracker(process: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


@pytest.fixture(autouse=True, scope="module")
def _no_leftover_processes():
    """Fail a test module that leaves a child process alive, after killing the whole tree.

    Module scope: a server fixture may live for a module, never longer (no session-scoped processes).
    """
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # Python's multiprocessing resource tracker is the interpreter's own helper, started at the first
    # semaphore or shared memory whichever test that is, and kept until the interpreter exits: not a test's.
    leftovers = [
        p for p in me.children(recursive=True) if p.pid not in before and not _is_resource_tracker(p)
    ]
    names = []  # read before the kill: a killed process has no command line left to name it by
    for p in leftovers:
        try:
            names.append(f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            names.append(str(p.pid))
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=10)
    alive = [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, f"test left processes running (killed now, alive={len(alive)}): {names}"
