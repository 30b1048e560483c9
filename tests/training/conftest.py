"""Fixtures of the trainer tests: the tiny model's chat tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from art_sglang.training.tokenize import ChatTokenizer


@pytest.fixture(scope="session")
def chat(tokenizer: Any, tiny_model_path: Path) -> ChatTokenizer:
    return ChatTokenizer.for_model(tokenizer, tiny_model_path)
