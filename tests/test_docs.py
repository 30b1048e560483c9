"""The generated configuration reference matches the code, README's test command is what CI runs, and the
Python in the user docs compiles and uses only public names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import art_sglang

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


USER_DOCS = ("README.md", "docs/quickstart.md", "docs/guide.md", "docs/migrating-from-local-backend.md")


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_the_python_in_the_user_docs_compiles(doc: str) -> None:
    for block in _python_blocks(doc):
        compile(block, doc, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_art_sglang_name_the_user_docs_use_is_public(doc: str) -> None:
    # `art.X` where the block does `import art_sglang as art`, and `from art_sglang import X`.
    used: set[str] = set()
    for block in _python_blocks(doc):
        if "import art_sglang as art" in block:
            used |= set(re.findall(r"\bart\.([A-Za-z_]\w*)", block))
        for names in re.findall(r"from art_sglang import ([\w, ]+)", block):
            used |= {name.strip() for name in names.split(",")}
    assert used - set(art_sglang.__all__) == set()
