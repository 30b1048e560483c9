"""Rank 0's checkpoint writer: the adapter file is what safetensors' save_file writes, and the parts it
reports count the wait for the step before, wherever the trainer settled it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from peft.utils import load_peft_weights
from safetensors.torch import load_file, save_file

from art_sglang.storage import checkpoints as ckpt
from art_sglang.training.checkpoint_writer import CheckpointWriter, save_adapter_weights

MODULES = {"q_proj": (48, 32), "down_proj": (32, 80)}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """LoRA A/B tensors named as peft saves them, fp32 and one bf16 pair."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module, (out, inp) in MODULES.items():
            dtype = torch.bfloat16 if module == "down_proj" and layer == 1 else torch.float32
            prefix = f"base_model.model.model.layers.{layer}.mlp.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(4, inp, generator=generator).to(dtype)
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, 4, generator=generator).to(dtype)
    return weights


def optimizer_state(weights: dict[str, torch.Tensor]) -> dict:
    return {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": t.float().clone()}
            for i, t in enumerate(weights.values())
        },
        "param_groups": [{"lr": 1e-3, "params": list(range(len(weights)))}],
    }


def write(writer: CheckpointWriter, folder: Path, step: int, weights: dict[str, torch.Tensor]) -> Path:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(MODULES))
    return writer.write(folder, step, (weights, config), optimizer_state(weights), {"step": step})


def test_the_adapter_file_is_byte_for_byte_what_save_file_writes(tmp_path: Path) -> None:
    weights = adapter(0)
    writer = CheckpointWriter()
    path = write(writer, tmp_path / "checkpoints", 1, weights)
    writer.close()
    save_file(weights, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    written = (path / ckpt.ADAPTER_WEIGHTS).read_bytes()
    assert written == (tmp_path / "reference.safetensors").read_bytes()
    for loaded in (load_file(str(path / ckpt.ADAPTER_WEIGHTS)), load_peft_weights(str(path), device="cpu")):
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[k], t) and loaded[k].dtype == t.dtype for k, t in weights.items())


def test_only_whole_host_tensors_are_written(tmp_path: Path) -> None:
    """The library reads raw memory: a strided view would be written as the memory under it, not its values."""
    view = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match="not contiguous"):
        save_adapter_weights({"a": view}, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


def test_the_wait_counts_a_settle_before_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer settles the step before on its own (to word a failed background write), then writes:
    `wait` is that settle's time, not only the write's own settle, which finds nothing left; a settle of
    another purpose (start-up's, the worker's exit) is no write's part."""
    writer = CheckpointWriter()
    fsync = os.fsync

    def write_held(step: int) -> None:
        """Write `step`, its background fsyncs held until 0.5 s after the write returned."""
        writer.settle()  # the step before's fsyncs not held
        release = threading.Event()
        monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(30), fsync(fd)))
        write(writer, tmp_path, step, adapter(step))
        threading.Timer(0.5, release.set).start()

    write(writer, tmp_path, 1, adapter(1))
    assert writer.seconds["wait"] == 0  # nothing before it
    write_held(2)
    writer.settle(before_write=True)  # as trainer._write does
    write_held(3)
    assert writer.seconds["wait"] >= 0.4
    assert set(writer.seconds) == {"wait", "copy", "adapter", "other_files", "rename"}
    started = time.perf_counter()
    writer.settle()
    assert time.perf_counter() - started >= 0.3  # it did wait for step 3's fsyncs
    monkeypatch.setattr(os, "fsync", fsync)
    write(writer, tmp_path, 4, adapter(4))
    writer.close()
    assert writer.seconds["wait"] == 0
    assert ckpt.list_checkpoints(tmp_path) == [1, 2, 3, 4]


@pytest.mark.gpu
def test_a_gpu_state_is_saved_as_it_was_at_the_write(tmp_path: Path) -> None:
    """The optimizer state's transfers finish in the background: kernels queued after the write (the next
    step's) change the GPU tensors, not what optimizer.pt holds."""
    weights = {name: t.float().cuda() for name, t in adapter(5).items()}
    state = optimizer_state(weights)
    expected = {i: entry["exp_avg"].cpu() for i, entry in state["state"].items()}
    expected_weights = {name: t.cpu() for name, t in weights.items()}
    writer = CheckpointWriter()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(MODULES))
    path = writer.write(tmp_path, 1, (weights, config), state, {"step": 1})
    for entry in state["state"].values():
        entry["exp_avg"].mul_(0).add_(7)  # queued behind the transfers on the same stream
    for t in weights.values():
        t.add_(1)
    writer.close()
    saved = torch.load(path / ckpt.OPTIMIZER)["state"]
    assert all(torch.equal(saved[i]["exp_avg"], expected[i]) for i in expected)
    on_disk = load_file(str(path / ckpt.ADAPTER_WEIGHTS))
    assert all(torch.equal(on_disk[k], t) for k, t in expected_weights.items())
