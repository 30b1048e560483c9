"""Fixtures of the trainer tests: the tiny model's tokenizer and its chat tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from art_sglang.training.tokenize import ChatTokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def chat(tokenizer: Any, tiny_model_path: Path) -> ChatTokenizer:
    return ChatTokenizer.for_model(tokenizer, tiny_model_path)
