"""SGLangConfig's defaults that the user's environment sets: the isolated server venv's interpreter, and how
long a server's start may take."""

from __future__ import annotations

import os
from pathlib import Path

SERVER_PYTHON_ENV = "ART_SGLANG_SERVER_PYTHON"
SERVER_TIMEOUT_ENV = "ART_SERVER_TIMEOUT"
SERVER_VENV_DIR = ".venv-sglang-server"


def default_server_timeout() -> float:
    """SGLangConfig.server_timeout's default: `$ART_SERVER_TIMEOUT`, else 600 s."""
    raw = os.environ.get(SERVER_TIMEOUT_ENV)
    if raw is None:
        # A cold SGLang start measured 181-197 s on an H100 (CUDA-graph capture); 600 s leaves room.
        return 600.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{SERVER_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def find_server_python(start: Path | None = None) -> str | None:
    """The isolated server venv's python: `$ART_SGLANG_SERVER_PYTHON`, else `.venv-sglang-server/bin/python`
    in the working directory or one of its parents, else None."""
    explicit = os.environ.get(SERVER_PYTHON_ENV)
    if explicit:
        return explicit
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / SERVER_VENV_DIR / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None
