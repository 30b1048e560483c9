"""Fault tests share the backend tests' helpers (real reference-engine servers and trainer workers)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
