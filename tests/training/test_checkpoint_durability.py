"""A checkpoint's fsyncs leave the step's path: the step answers once its folder is renamed into place, a
background thread puts it on disk before the next checkpoint, and a newest step torn by a power loss in
between (a file shorter than trainer_state.json recorded, or unreadable) is set aside for the one before."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from training_helpers import make_choice, trajectory

from art_sglang.config import TrainerConfig
from art_sglang.storage import checkpoints as ckpt
from art_sglang.training.options import TrainOptions
from art_sglang.training.trainer import Trainer
from art_sglang.training.validation import groups_to_wire
from art_sglang.trajectories import TrajectoryGroup

OPTIONS = TrainOptions(learning_rate=5e-2)


def batch(tokenizer: Any, seed: int) -> list[dict[str, Any]]:
    answers = [("1 2 3", 1.0), ("a b", 0.0), (f"{seed} z", 0.5)]
    return groups_to_wire(
        [
            TrajectoryGroup(
                [trajectory(f"task {seed} {g}", make_choice(tokenizer, a), r) for a, r in answers]
            )
            for g in range(2)
        ]
    )


def lora_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_the_step_answers_before_its_files_are_fsynced(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fsync of a step's checkpoint runs in the background thread, and the next checkpoint waits for
    them; the folder records its published files' sizes."""
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    trainer.settle()
    threads: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (threads.append(threading.current_thread().name), fsync(fd)))
    outcome = trainer.train(batch(tokenizer, 1), OPTIONS, lambda _: None)
    trainer.settle()
    assert threads and not [name for name in threads if name == threading.main_thread().name]
    folder = outcome.checkpoint_path
    assert folder is not None
    recorded = ckpt.read_trainer_state(folder)[ckpt.SIZES_KEY]
    assert recorded == {name: (folder / name).stat().st_size for name in ckpt.SIZED_FILES}
    trainer.close()


def test_a_step_set_aside_while_its_files_are_synced_is_synced_where_it_went(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend sets a refused step aside right after its answer, while the background fsyncs may still
    run: they follow the folder, and the next checkpoint is not failed by the move."""
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    trainer.settle()
    release = threading.Event()
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(30), fsync(fd)))
    outcome = trainer.train(batch(tokenizer, 1), OPTIONS, lambda _: None)
    assert outcome.checkpoint_path is not None
    aside = ckpt.set_aside(outcome.checkpoint_path)
    release.set()
    trainer.settle()
    assert sorted(p.name for p in aside.iterdir()) == sorted(ckpt.CHECKPOINT_FILES)
    outcome = trainer.train(batch(tokenizer, 2), OPTIONS, lambda _: None)
    assert outcome.step == 2
    trainer.close()


@pytest.fixture(scope="module")
def two_steps(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any
) -> tuple[Path, dict]:
    """A checkpoint folder with steps 0-2 on disk, and step 1's adapter weights."""
    folder = tmp_path_factory.mktemp("two-steps")
    trainer = Trainer(str(tiny_model_path), folder, TrainerConfig())
    trainer.resume_or_init()
    trainer.train(batch(tokenizer, 1), OPTIONS, lambda _: None)
    step_one = lora_weights(trainer)
    trainer.train(batch(tokenizer, 2), OPTIONS, lambda _: None)
    trainer.close()
    return folder, step_one


@pytest.mark.parametrize("name", [*ckpt.PUBLISHED_FILES, ckpt.OPTIMIZER])
def test_a_torn_newest_step_is_set_aside_for_the_one_before(
    two_steps: tuple[Path, dict], tiny_model_path: Path, tmp_path: Path, name: str
) -> None:
    """A power loss before the background fsyncs can leave the newest step's files shorter than written;
    resume and the listing skip that step. optimizer.pt is renamed into place only after its own fsync
    (whole or absent), so a torn one costs the optimizer's moments only, as a missing one does."""
    source, step_one = two_steps
    folder = tmp_path / "checkpoints"
    shutil.copytree(source, folder)
    torn = folder / "0002" / name
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    resumed = Trainer(str(tiny_model_path), folder, TrainerConfig())
    if name == ckpt.OPTIMIZER:
        assert resumed.resume_or_init() == 2 and not resumed.optimizer.state
        resumed.close()
        return
    if name != ckpt.TRAINER_STATE:  # an unreadable trainer state records no sizes to list by
        assert ckpt.list_checkpoints(folder) == [0, 1]
    assert resumed.resume_or_init() == 1
    assert [n for n in resumed.notes if "0002 cannot be resumed" in n and torn.name in n], resumed.notes
    assert sorted(p.name.split(".")[0] for p in folder.iterdir()) == ["0000", "0001", "0002"]
    assert list(folder.glob("0002.broken-*"))
    for key, value in lora_weights(resumed).items():
        assert torch.equal(value, step_one[key]), key
    assert resumed.optimizer.state  # step 1's optimizer state, whole
    resumed.close()
