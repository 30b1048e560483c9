"""Issue 40's correctness items on the reference engine (float32), the bodies the GPU runs on SGLang
(tests/gpu/test_merged_against_lora_on_gpu.py, tests/backend/merged_checks.py): after a few merged steps the
served logprobs equal those of a LoRA server holding the last step's adapter, and a server killed mid-push
leaves the served name on whole weights of one step."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from backend_helpers import sample_groups
from merged_checks import Training, crash_mid_push, merged_against_lora
from test_merged_sync import BUCKET_BYTES

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig

# float32 on both sides; merged weights (W + s·BA) and LoRA applied on the side (Wx + s·B(Ax)) round
# differently, by ~1e-6 of a logprob here; a step at the learning rate below moves them ~0.1.
TOLERANCE = 1e-5


def _training() -> Training:
    seeds = itertools.count(1)
    return Training(
        groups=lambda model: sample_groups(model, seed=next(seeds)), learning_rate=5e-2, tolerance=TOLERANCE
    )


def _backend(root: Path, **config: Any) -> SGLangBackend:
    settings = SGLangConfig(weight_sync_method="merged", **config)
    return SGLangBackend(path=str(root / ".art"), sglang_config=settings)


async def test_merged_steps_serve_what_lora_serves_of_the_same_adapter(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    await merged_against_lora(_backend(tmp_path), model, _training(), steps=2, log_dir=tmp_path)


async def test_a_server_killed_mid_push_serves_whole_weights_of_one_step(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    backend = _backend(tmp_path, merged_bucket_bytes=BUCKET_BYTES)
    await crash_mid_push(backend, model, _training(), tmp_path, monkeypatch)
