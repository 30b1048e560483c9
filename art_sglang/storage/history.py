"""history.jsonl: one JSON object per line, in ART's row format (`{...metrics, "step", "recorded_at"}`).

`train()` appends a row with the training metrics and timings of each step; `model.log()` appends its own
rows to the same file. JSON has no NaN or infinity: such values are written as null, so every line stays
valid JSON for any reader.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any


def append_row(path: Path, step: int, metrics: dict[str, float]) -> dict[str, Any]:
    """Append one row for `step` and return it. One write of one line, so a reader never sees half a row
    from a completed call."""
    row: dict[str, Any] = {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in metrics.items()
    }
    row.update(step=step, recorded_at=datetime.now().isoformat())
    line = json.dumps(row, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(line + "\n")
    return row


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of a history file (none if it does not exist). A torn last line (a crash mid-write) is
    skipped rather than failing the whole read."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
