"""Fixtures of the GPU suite (marker `gpu`; run with `pytest -m gpu tests/gpu` on a machine with a GPU and
the SGLang server venv). Every test here is skipped where there is no GPU or no SGLang.

Servers start slowly on real SGLang (76-197 s), so each module starts one backend (module-scoped) and its
tests run in file order against it, each checking one behaviour of the same run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from gpu_models import build_gpu_model

from art_sglang.config import SGLangConfig
from art_sglang.planning.devices import detect_gpus

TINY_ENV = "ART_SGLANG_GPU_TINY"  # a prebuilt tests/gpu/gpu_models.py "tiny" model (the device script's)


@pytest.fixture(scope="session", autouse=True)
def _gpu_and_sglang() -> None:
    found = detect_gpus()
    if not found.gpus:
        pytest.skip(f"no GPU ({found.detail})")
    python = SGLangConfig().resolved_server_python()
    probe = subprocess.run([python, "-c", "import sglang"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"SGLang does not import with {python} (run scripts/setup_sglang.sh)")


@pytest.fixture(scope="session")
def gpu_count() -> int:
    return len(detect_gpus().gpus)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny bf16 Qwen2 (head_dim 64) used for correctness on the GPU."""
    prebuilt = os.environ.get(TINY_ENV)
    if prebuilt:
        return str(build_gpu_model(Path(prebuilt), "tiny"))
    return str(build_gpu_model(tmp_path_factory.mktemp("gpu-model") / "tiny", "tiny"))
