"""Checkpoint folders `<checkpoint_dir>/<step:04d>/`: a PEFT adapter (adapter_config.json +
adapter_model.safetensors, loadable by peft and by SGLang's /load_lora_adapter), optimizer.pt and
trainer_state.json. A checkpoint is written into `<step:04d>.tmp-<random>` in the same folder, then
renamed into place, so no reader (the server, a resume after the process died) ever sees a half-written
folder under a step name. Its fsyncs follow the rename (`LateFile.sync_published`, run by the trainer's
writer in the background before the next checkpoint): until then a power loss or kernel crash can leave
the newest step's files torn, so trainer_state.json records the published files' sizes (`SIZES_KEY`) and a step whose
files differ from them (`wrong_sizes`) is neither listed nor resumed; the step before it is whole, its
fsyncs done before this one was renamed.
The optimizer state may follow the rename (`LateFile`: a temp name, fsync, rename, so it is there whole
or not at all): trainer_state.json lists the files of the complete step, and a step that lacks one of them
(the trainer stopped before it was written) is incomplete (`missing_files`). Its adapter was published
(served under its name), so it is still resumed, with a fresh optimizer.

ART's LocalBackend writes the same layout with the adapter files only; such a folder is a checkpoint too
(resumed with a fresh optimizer). A folder under a step name that is not a readable adapter is never
deleted or replaced: `set_aside` renames it to `<step:04d>.broken-<time>`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER, TRAINER_STATE)
# What the rename needs (the adapter serves from then on); optimizer.pt may follow.
PUBLISHED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_STATE)
COMPLETE_FILES_KEY = "files"  # in trainer_state.json: every file of the complete step
SIZES_KEY = "sizes"  # in trainer_state.json: the bytes of each published file but itself
SIZED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
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
    """Steps whose folder holds an adapter of the size its trainer state recorded, ascending; temp and
    set-aside folders are ignored."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in folder.iterdir()
        if p.is_dir() and _STEP_DIR.match(p.name) and has_adapter(p) and not _torn(p)
    )


def _torn(path: Path) -> bool:
    """Files of different sizes than trainer_state.json recorded (an unreadable one records nothing)."""
    try:
        return bool(wrong_sizes(path, read_trainer_state(path)))
    except (OSError, ValueError):
        return False


def file_sizes(folder: Path) -> dict[str, int]:
    """The bytes of SIZED_FILES in `folder`, for trainer_state.json's SIZES_KEY."""
    return {name: (Path(folder) / name).stat().st_size for name in SIZED_FILES}


def wrong_sizes(path: Path, trainer_state: dict[str, Any]) -> list[str]:
    """The files whose size differs from what `trainer_state` recorded: written but not yet on disk when
    the machine stopped (none recorded: an older checkpoint, or ART's)."""
    recorded = trainer_state.get(SIZES_KEY) or {}
    found = {}
    for name in recorded:
        try:
            found[name] = (Path(path) / name).stat().st_size
        except OSError:
            found[name] = None
    return [name for name, size in recorded.items() if found[name] != size]


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
    """Run `write(tmp)` to fill a temp folder (at least PUBLISHED_FILES) and rename it to `<step:04d>`;
    `LateFile.sync_published` puts it on disk. A folder already at that name that holds no adapter is set aside
    first; one that holds an adapter is never replaced."""
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}{_TMP_MARK}", dir=folder))
    try:
        write(tmp)
        missing = [name for name in PUBLISHED_FILES if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"checkpoint {step} is missing {missing}")
        if final.exists():
            if has_adapter(final):
                raise FileExistsError(f"checkpoint {final} already exists")
            set_aside(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class LateFile:
    """A file of a checkpoint written after its folder is renamed into place. Created in the temp folder
    with its space taken, so a full disk fails the checkpoint's write, not this file later; `finish` fills
    it, fsyncs it and renames it to its name through a descriptor of the folder (which follows the folder's
    renames: into place, or aside), so it is there whole or not at all."""

    def __init__(self, folder: Path, name: str, size: int) -> None:
        self._name = name
        self._tmp = f"{name}{_TMP_MARK}{secrets.token_hex(4)}"
        self._folder = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self._folder)
        except BaseException:
            os.close(self._folder)
            raise
        try:
            os.posix_fallocate(self._fd, 0, max(size, 1))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without reservations
                self.close()
                raise

    def sync_published(self) -> None:
        """Put what was published with the folder on disk: every file in it, the folder, and the folder
        above (its rename into place), through descriptors that follow the folder's renames."""
        for name in os.listdir(self._folder):
            fd = os.open(name, os.O_RDONLY, dir_fd=self._folder)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=self._folder)
        try:
            for fd in (self._folder, parent):
                with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
                    os.fsync(fd)
        finally:
            os.close(parent)

    def finish(self, write: Callable[[BinaryIO], None]) -> None:
        """Write the file (again, after a failed try) and rename it into place."""
        with os.fdopen(os.dup(self._fd), "r+b") as stream:
            stream.seek(0)
            write(stream)
            stream.truncate()
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(self._tmp, self._name, src_dir_fd=self._folder, dst_dir_fd=self._folder)
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(self._folder)

    def close(self) -> None:
        for fd in (self._fd, self._folder):
            with contextlib.suppress(OSError):
                os.close(fd)


def is_complete(path: Path) -> bool:
    """An adapter, and every file its trainer_state.json lists (the optimizer state follows the step's
    answer by a moment); unreadable trainer state counts as incomplete."""
    if not has_adapter(path):
        return False
    if not (Path(path) / TRAINER_STATE).exists():  # ART's layout: the adapter is the whole step
        return True
    try:
        return not missing_files(path, read_trainer_state(path))
    except (OSError, ValueError):
        return False


def missing_files(path: Path, trainer_state: dict[str, Any]) -> list[str]:
    """The files of the complete step (as its trainer_state.json lists them) that the folder lacks."""
    return [name for name in trainer_state.get(COMPLETE_FILES_KEY, ()) if not (Path(path) / name).is_file()]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / TRAINER_STATE).read_text())
