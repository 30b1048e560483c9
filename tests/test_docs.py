"""The generated configuration reference matches the code, and README's test command is what CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_ci_runs_the_test_command_readme_gives() -> None:
    ci_lines = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m")
    ]
    assert len(ci_lines) == 1
    assert ci_lines[0] in (ROOT / "README.md").read_text()
