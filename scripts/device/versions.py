"""Print the versions that docs/verification.md records, as JSON (run with the device env sourced)."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import PackageNotFoundError, version


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    server = subprocess.run(
        [
            "/tmp/sglang-python",
            "-c",
            "import sglang, transformers, torch; "
            "print(sglang.__version__, transformers.__version__, torch.__version__)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    sglang, server_transformers, server_torch = (server.stdout.split() + [None] * 3)[:3]
    record = {
        "gpus": gpu.splitlines(),
        "sglang": sglang,
        "sglang_transformers": server_transformers,
        "sglang_torch": server_torch,
        "server_error": server.stderr[-500:] if server.returncode else None,
        **{
            name: _version(name)
            for name in ("torch", "transformers", "peft", "unsloth", "unsloth_zoo", "trl")
        },
    }
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
