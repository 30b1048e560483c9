"""ART programs (openpipe-art's own classes) on SGLangBackend, CPU reference engine."""

from __future__ import annotations

import pytest


@pytest.fixture
def ART(openpipe_art):
    return openpipe_art
