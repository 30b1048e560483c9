"""The fault tests reuse the trainer and backend tests' helpers."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in ("training", "backend"):
    path = str(Path(__file__).resolve().parents[1] / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
