"""A step is applied, saved and counted together or not at all, through the real trainer worker: a step
whose loss is not finite, and a checkpoint that cannot be written because the disk is full (a real tmpfs),
raise TrainingError and leave the trainer exactly where it was (the next step equals an uninterrupted
run's, with no hole in the step numbers)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_helpers import settled
from safetensors.torch import load_file
from training_helpers import make_choice, trajectory

from art_sglang.config import TrainerConfig
from art_sglang.errors import TrainingError
from art_sglang.storage.checkpoints import list_checkpoints
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess
from art_sglang.trajectories import TrajectoryGroup

PPO = TrainOptions(loss_fn="ppo", learning_rate=5e-2)


def groups(tokenizer: Any, seed: int, poison: bool = False) -> list[TrajectoryGroup]:
    answers = [("1 2 3", 1.0), ("a b", 0.0), (f"{seed} z", 0.5)]
    out = []
    for g in range(2):
        items = []
        for text, reward in answers:
            choice = make_choice(tokenizer, text, [-3.0] * 5)
            if poison and reward == 0.0 and g == 1:
                # Plausible, finite, but for PPO with a negative advantage the ratio exp(new + 900)
                # overflows: the loss is infinite.
                choice.logprobs.content[0].logprob = -900.0
            items.append(trajectory(f"task {seed} {g}", choice, reward))
        out.append(TrajectoryGroup(items))
    return out


def worker(folder: Path, checkpoints: Path, model: Path) -> TrainerProcess:
    return TrainerProcess(
        str(model), checkpoints, TrainerConfig(), gpu_ids=None, log_path=folder / "trainer.log"
    )


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` once its checkpoints are complete (optimizer.pt follows a step's answer)."""
    settled(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_step(got: Path, expected: Path) -> None:
    a, b = load_file(expected / "adapter_model.safetensors"), load_file(got / "adapter_model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7)
    opt_a, opt_b = torch.load(expected / "optimizer.pt")["state"], torch.load(got / "optimizer.pt")["state"]
    assert opt_a.keys() == opt_b.keys()
    for index in opt_a:
        assert float(opt_a[index]["step"]) == float(opt_b[index]["step"])
        torch.testing.assert_close(
            opt_b[index]["exp_avg_sq"], opt_a[index]["exp_avg_sq"], rtol=1e-5, atol=1e-12
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, tokenizer: Any) -> Path:
    """Step 2 of a run that trained two good batches without any fault."""
    import asyncio

    folder = tmp_path_factory.mktemp("uninterrupted")
    proc = worker(folder, folder / "checkpoints", tiny_model_path)

    async def run() -> Path:
        try:
            await proc.start()
            await proc.train(groups(tokenizer, 1), PPO)
            outcome = await proc.train(groups(tokenizer, 2), PPO)
        finally:
            await proc.stop()
        assert outcome.checkpoint_path is not None
        return outcome.checkpoint_path

    return asyncio.run(run())


async def test_non_finite_loss_is_refused_and_rolled_back(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any, uninterrupted: Path
) -> None:
    proc = worker(tmp_path, tmp_path / "checkpoints", tiny_model_path)
    try:
        await proc.start()
        assert (await proc.train(groups(tokenizer, 1), PPO)).step == 1
        before = files(tmp_path / "checkpoints")
        with pytest.raises(TrainingError, match=r"the loss is not finite \(inf\).*not applied"):
            await proc.train(groups(tokenizer, 9, poison=True), PPO)
        assert files(tmp_path / "checkpoints") == before
        outcome = await proc.train(groups(tokenizer, 2), PPO)
    finally:
        await proc.stop()
    assert outcome.step == 2 and outcome.checkpoint_path is not None
    assert_same_step(outcome.checkpoint_path, uninterrupted)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (needs root and mount rights; skipped where the machine has neither)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_full_disk_is_refused_and_rolled_back(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any, uninterrupted: Path, small_disk: Path
) -> None:
    checkpoints = small_disk / "checkpoints"
    proc = worker(tmp_path, checkpoints, tiny_model_path)
    filler = small_disk / "filler"
    try:
        await proc.start()
        first = await proc.train(groups(tokenizer, 1), PPO)
        assert first.checkpoint_path is not None
        size = sum(len(content) for name, content in files(checkpoints).items() if name.startswith("0001/"))
        # Leave room for half a checkpoint.
        with filler.open("wb") as handle, contextlib.suppress(OSError):
            handle.write(b"\0" * (shutil.disk_usage(small_disk).free - size // 2))
        before = files(checkpoints)
        for _ in range(2):  # twice: a failed save must not leave a hole in the step numbers
            with pytest.raises(
                TrainingError, match=r"checkpoint 2 could not be written .*no space left on the device"
            ):
                await proc.train(groups(tokenizer, 2), PPO)
        assert files(checkpoints) == before and list_checkpoints(checkpoints) == [0, 1]
        filler.unlink()
        outcome = await proc.train(groups(tokenizer, 2), PPO)
    finally:
        await proc.stop()
    assert outcome.step == 2 and list_checkpoints(checkpoints) == [0, 1, 2]
    assert outcome.checkpoint_path is not None
    assert_same_step(outcome.checkpoint_path, uninterrupted)
