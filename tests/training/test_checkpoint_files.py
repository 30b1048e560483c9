"""Checkpoint folders: written atomically, listed only when complete, temp leftovers cleaned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from art_sglang.storage import checkpoints as ckpt


def fill(folder: Path) -> None:
    for name in ckpt.CHECKPOINT_FILES:
        (folder / name).write_text("{}")


def test_write_list_latest(tmp_path: Path) -> None:
    assert ckpt.list_checkpoints(tmp_path / "none") == [] and ckpt.list_checkpoints(tmp_path) == []
    for step in (0, 2, 10):
        path = ckpt.write_checkpoint(tmp_path, step, fill)
        assert path == tmp_path / f"{step:04d}"
        assert sorted(f.name for f in path.iterdir()) == sorted(ckpt.CHECKPOINT_FILES)
    assert ckpt.list_checkpoints(tmp_path) == [0, 2, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0002", "0010"]  # no temp left


def test_partial_and_temp_folders_are_not_checkpoints(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, 1, fill)
    partial = tmp_path / "0005"
    partial.mkdir()
    (partial / ckpt.ADAPTER_CONFIG).write_text("{}")  # crashed before the rest
    temp = tmp_path / "0006.tmp-abc"
    temp.mkdir()
    fill(temp)
    broken = tmp_path / "0007"
    broken.mkdir()
    fill(broken)
    (broken / ckpt.TRAINER_STATE).write_text("{trunc")
    # 0007's adapter is intact (it can be served); resume sets it aside for its trainer state.
    assert ckpt.list_checkpoints(tmp_path) == [1, 7]
    ckpt.remove_stale_temp_dirs(tmp_path)
    assert not temp.exists()
    # A folder without an adapter at the target step is set aside, not deleted, by the complete write.
    ckpt.write_checkpoint(tmp_path, 5, fill)
    assert ckpt.list_checkpoints(tmp_path) == [1, 5, 7]
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("0005.broken-")]
    assert sorted(f.name for f in aside.iterdir()) == [ckpt.ADAPTER_CONFIG]


def test_a_published_file_of_another_size_than_recorded_is_torn(tmp_path: Path) -> None:
    """trainer_state.json records the published files' sizes: a file that differs (a power loss before the
    fsyncs, which follow the rename) takes its step out of the listing, whatever its content."""

    def sized(folder: Path) -> None:
        fill(folder)
        ckpt.write_json(folder / ckpt.TRAINER_STATE, {ckpt.SIZES_KEY: ckpt.file_sizes(folder)})

    for step in (1, 2):
        ckpt.write_checkpoint(tmp_path, step, sized)
    newest = tmp_path / "0002"
    assert ckpt.wrong_sizes(newest, ckpt.read_trainer_state(newest)) == []
    (newest / ckpt.ADAPTER_WEIGHTS).write_text("{ }")  # parses as well as "{}" did
    assert ckpt.wrong_sizes(newest, ckpt.read_trainer_state(newest)) == [ckpt.ADAPTER_WEIGHTS]
    assert ckpt.list_checkpoints(tmp_path) == [1]


def test_adapter_only_folder_as_art_writes_it_is_a_checkpoint_and_never_replaced(tmp_path: Path) -> None:
    art_step = tmp_path / "0003"
    art_step.mkdir()
    for name in (ckpt.ADAPTER_CONFIG, ckpt.ADAPTER_WEIGHTS):
        (art_step / name).write_text("{}")
    assert ckpt.list_checkpoints(tmp_path) == [3]
    with pytest.raises(FileExistsError):
        ckpt.write_checkpoint(tmp_path, 3, fill)
    assert sorted(f.name for f in art_step.iterdir()) == [ckpt.ADAPTER_CONFIG, ckpt.ADAPTER_WEIGHTS]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def half(folder: Path) -> None:
        (folder / ckpt.ADAPTER_CONFIG).write_text("{}")

    with pytest.raises(RuntimeError, match="missing"):
        ckpt.write_checkpoint(tmp_path, 3, half)

    def crash(folder: Path) -> None:
        fill(folder)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.write_checkpoint(tmp_path, 3, crash)
    assert list(tmp_path.iterdir()) == []


def test_existing_complete_checkpoint_is_not_overwritten(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, 4, fill)
    with pytest.raises(FileExistsError):
        ckpt.write_checkpoint(tmp_path, 4, fill)


def test_a_late_file_is_there_whole_or_not_at_all_and_follows_its_folder(tmp_path: Path) -> None:
    """The optimizer state written after the rename: a failed write leaves no file under its name, and a
    step set aside meanwhile (the server refused it) takes the file along."""
    late: list[ckpt.LateFile] = []

    def published(folder: Path) -> None:
        for name in ckpt.PUBLISHED_FILES:
            (folder / name).write_text("{}")
        ckpt.write_json(folder / ckpt.TRAINER_STATE, {ckpt.COMPLETE_FILES_KEY: list(ckpt.CHECKPOINT_FILES)})
        late.append(ckpt.LateFile(folder, ckpt.OPTIMIZER, 1024))

    path = ckpt.write_checkpoint(tmp_path, 1, published)
    assert ckpt.list_checkpoints(tmp_path) == [1] and not ckpt.is_complete(path)

    def fails(stream: Any) -> None:
        stream.write(b"half")
        raise OSError("I/O error")

    with pytest.raises(OSError, match="I/O error"):
        late[0].finish(fails)
    assert not (path / ckpt.OPTIMIZER).exists() and not ckpt.is_complete(path)
    aside = ckpt.set_aside(path)
    late[0].finish(lambda stream: stream.write(b"state"))
    late[0].close()
    assert (aside / ckpt.OPTIMIZER).read_bytes() == b"state" and ckpt.is_complete(aside)
    assert sorted(p.name for p in aside.iterdir()) == sorted(ckpt.CHECKPOINT_FILES)
