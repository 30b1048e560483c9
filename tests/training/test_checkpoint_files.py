"""Checkpoint folders: written atomically, listed only when complete, temp leftovers cleaned."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_sglang.training import checkpoints as ckpt


def fill(folder: Path) -> None:
    for name in ckpt.CHECKPOINT_FILES:
        (folder / name).write_text("{}")


def test_write_list_latest(tmp_path: Path) -> None:
    assert ckpt.list_checkpoints(tmp_path / "none") == [] and ckpt.latest_checkpoint(tmp_path) is None
    for step in (0, 2, 10):
        path = ckpt.write_checkpoint(tmp_path, step, fill)
        assert path == tmp_path / f"{step:04d}" and ckpt.is_complete(path)
    assert ckpt.list_checkpoints(tmp_path) == [0, 2, 10]
    assert ckpt.latest_checkpoint(tmp_path) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0002", "0010"]  # no temp left


def test_partial_and_temp_folders_are_ignored(tmp_path: Path) -> None:
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
    assert ckpt.list_checkpoints(tmp_path) == [1]
    ckpt.remove_stale_temp_dirs(tmp_path)
    assert not temp.exists()
    # A partial folder at the target step is replaced by the complete write.
    ckpt.write_checkpoint(tmp_path, 5, fill)
    assert ckpt.list_checkpoints(tmp_path) == [1, 5]


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
