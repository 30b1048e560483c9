"""Checkpoint folders `<checkpoint_dir>/<step:04d>/`: a PEFT adapter (adapter_config.json +
adapter_model.safetensors, loadable by peft and by SGLang's /load_lora_adapter), optimizer.pt and
trainer_state.json. A checkpoint is written into `<step:04d>.tmp-<random>` in the same folder, every
file fsynced, then renamed into place, so a crash never leaves a half-written folder under a step name.

ART's LocalBackend writes the same layout with the adapter files only; such a folder is a checkpoint too
(resumed with a fresh optimizer). A folder under a step name that is not a readable adapter is never
deleted or replaced: `set_aside` renames it to `<step:04d>.broken-<time>`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER, TRAINER_STATE)
_STEP_DIR = re.compile(r"^\d{4,}$")
_TMP_MARK = ".tmp-"
_BROKEN_MARK = ".broken-"


def checkpoint_path(checkpoint_dir: Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"{step:04d}"


def has_adapter(path: Path) -> bool:
    """The adapter files are there and adapter_config.json parses (this backend's checkpoint, or ART's)."""
    return _all_files(path, (ADAPTER_CONFIG, ADAPTER_WEIGHTS)) and _parses_as_json(path / ADAPTER_CONFIG)


def _all_files(folder: Path, names: Iterable[str]) -> bool:
    return all((folder / name).is_file() for name in names)


def _parses_as_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def list_checkpoints(checkpoint_dir: Path) -> list[int]:
    """Steps whose folder holds an adapter, ascending; temp and set-aside folders are ignored."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    return sorted(
        int(p.name) for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and has_adapter(p)
    )


def step_folders(checkpoint_dir: Path) -> list[Path]:
    """Every folder named as a step, newest first, whatever it holds."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(p.name), reverse=True)


def set_aside(path: Path) -> Path:
    """Rename a checkpoint folder that cannot be used to `<name>.broken-<time>` (kept for inspection,
    never again taken for a step) and return the new path."""
    target = path.with_name(f"{path.name}{_BROKEN_MARK}{time.strftime('%Y%m%d-%H%M%S')}")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('~')[0]}~{suffix}")
    os.replace(path, target)
    return target


def remove_stale_temp_dirs(checkpoint_dir: Path) -> None:
    """Delete leftovers of interrupted writes (only this trainer writes into the folder)."""
    folder = Path(checkpoint_dir)
    if folder.is_dir():
        for path in folder.iterdir():
            if _TMP_MARK in path.name and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(checkpoint_dir: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` to fill a temp folder, fsync it, and rename it to `<step:04d>`. A folder already
    at that name that holds no adapter is set aside first; one that holds an adapter is never replaced."""
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}{_TMP_MARK}", dir=folder))
    try:
        write(tmp)
        missing = [name for name in CHECKPOINT_FILES if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"checkpoint {step} is missing {missing}")
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        if final.exists():
            if has_adapter(final):
                raise FileExistsError(f"checkpoint {final} already exists")
            set_aside(final)
        os.replace(tmp, final)
        _fsync(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)
