"""An adapter's files as bytes, for nodes that cannot read the head's checkpoint folder: read on the head
(only what a server loads: the config and the weights, never the optimizer state next to them), written
atomically into a node-local folder, and a checksum both sides compute the same way."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..storage.model_store import ADAPTER_CONFIG, ADAPTER_WEIGHTS

AdapterBytes = dict[str, bytes]  # file name -> contents


_SERVED = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)


def read_adapter(path: Path) -> AdapterBytes:
    """The files of the adapter at `path` that a server loads."""
    return {name: (path / name).read_bytes() for name in _SERVED if (path / name).is_file()}


def adapter_version(path: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """What tells one write of the adapter at `path` from another (a refused step's folder is written
    again under the same path): its files' names, sizes and modification times."""
    stats = ((name, (path / name).stat()) for name in _SERVED if (path / name).is_file())
    return str(path), tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)


def checksum(files: AdapterBytes) -> str:
    """SHA-256 over the files' names and contents, in name order."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little"))
        digest.update(files[name])
    return digest.hexdigest()


def write_adapter(folder: Path, name: str, files: AdapterBytes) -> tuple[Path, str]:
    """Write `files` to `folder/<name>` through a temporary folder and a rename, so a server never sees
    half an adapter; returns the path and the checksum of what is on disk after the write (read back)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / _safe(name)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{final.name}."))
    try:
        for file, data in files.items():
            with open(staging / Path(file).name, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        if final.exists():  # the same name shipped again (a replaced step): the new files win
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, checksum({file.name: file.read_bytes() for file in final.iterdir()})


def remove_adapter(folder: Path, name: str) -> None:
    shutil.rmtree(folder / _safe(name), ignore_errors=True)


def _safe(name: str) -> str:
    # Served names are <model>@<step>; a "/" (never in model names, checked at register) must not nest.
    return name.replace("/", "_")
