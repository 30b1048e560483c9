"""ART programs (openpipe-art's own classes) on SGLangBackend, CPU reference engine."""

from __future__ import annotations

import pytest


@pytest.fixture
def ART(openpipe_art):
    return openpipe_art


@pytest.fixture(scope="session")
def tool_model_path(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with a sharpened output layer, so a few SFT steps teach it to call a tool."""
    from art_sglang.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tool-model"), logit_scale=25.0)
