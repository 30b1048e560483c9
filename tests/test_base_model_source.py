"""A base model whose files cannot be had (not local, not cached, the hub unreachable or without it) is
refused by register before any process starts, naming `base_model` and the fix."""

from __future__ import annotations

import time
from pathlib import Path

import huggingface_hub
import psutil
import pytest
from huggingface_hub import constants

import art_sglang as art
from art_sglang import ConfigError, SGLangBackend
from art_sglang.storage.base_model_source import base_model_source_problem

MISSING = "nobody-here/no-such-model"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _unreachable(*_: object, **__: object) -> None:
    raise ConnectionError("Name or service not known")


def test_local_and_cached_models_need_no_hub(tiny_model_path: Path, empty_cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    assert base_model_source_problem(str(tiny_model_path)) is None
    snapshot = empty_cache / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (empty_cache / "models--org--cached" / "refs").mkdir()
    (empty_cache / "models--org--cached" / "refs" / "main").write_text("abc123")
    assert base_model_source_problem("org/cached") is None
    assert base_model_source_problem("org/not-cached") is not None


def test_an_unreachable_hub_names_the_setting_and_the_fixes(empty_cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    problem = base_model_source_problem(MISSING)
    assert problem is not None
    assert f"base_model {MISSING!r}" in problem and "could not be reached" in problem
    assert f"hf download {MISSING}" in problem and "local model directory" in problem


def test_offline_mode_is_named(empty_cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    problem = base_model_source_problem(MISSING)
    assert problem is not None and "HF_HUB_OFFLINE is set" in problem and "hf download" in problem


async def test_register_refuses_it_before_any_process_starts(
    tmp_path: Path, empty_cache, monkeypatch
) -> None:
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    model = art.TrainableModel(name="agent", project="p", base_model=MISSING)
    before = len(psutil.Process().children(recursive=True))
    began = time.monotonic()
    async with SGLangBackend(path=str(tmp_path / ".art"), engine="reference") as backend:
        with pytest.raises(ConfigError, match=r"base_model 'nobody-here/no-such-model' is neither"):
            await model.register(backend)
        assert backend.inference is None
        assert len(psutil.Process().children(recursive=True)) == before
    assert time.monotonic() - began < 10
    assert not (tmp_path / ".art" / "p" / "models" / "agent" / "checkpoints").exists()
