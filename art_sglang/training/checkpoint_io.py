"""One checkpoint's tensors in and out of memory: the PEFT adapter (LoRA A/B only, what SGLang's loader
accepts), the optimizer state and the RNG state, read and checked before anything is applied; and a plain
reason for a write that failed. The folder layout and atomic writes are checkpoints.py's."""

from __future__ import annotations

import base64
import copy
import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..storage import checkpoints as ckpt


def write_failure(exc: BaseException, folder: Path) -> str:
    """A plain reason for a failed checkpoint write."""
    text = f"{type(exc).__name__}: {exc}"
    code = exc.errno if isinstance(exc, OSError) else None
    torch_write = isinstance(exc, RuntimeError) and ("inline_container" in text or "write failed" in text)
    if code in (errno.ENOSPC, errno.EDQUOT) or torch_write:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 * 2**20):
            where = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
            return f"no space left on the device{where}: free some space and train again ({text.splitlines()[0]})"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the folder is not writable: fix its permissions and train again ({text})"
    if code == errno.EFBIG:
        return f"a file exceeds the allowed file size (ulimit -f): raise the limit and train again ({text})"
    return text.splitlines()[0]


class CheckpointUnreadable(Exception):
    """A checkpoint file is missing, truncated or corrupt; the message names the file."""


@dataclass
class CheckpointState:
    """A checkpoint read into memory, every file checked before anything is applied to the model."""

    adapter_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # None: the folder has none (ART's layout), or it is unreadable
    trainer_state: dict[str, Any] | None
    optimizer_problem: str | None = None  # why the optimizer state cannot be read; the adapter still can


def read_checkpoint(path: Path, device: torch.device) -> CheckpointState:
    """Read a checkpoint folder; CheckpointUnreadable names the first file that cannot be used. An
    optimizer state that cannot be read is only reported (`optimizer_problem`): the adapter is what a
    checkpoint is for, and it resumes with a fresh optimizer."""
    import json

    from safetensors.torch import load_file

    def unreadable(name: str, exc: BaseException | str) -> CheckpointUnreadable:
        return CheckpointUnreadable(f"{path / name}: {exc}")

    try:
        adapter_config = json.loads((path / ckpt.ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise unreadable(ckpt.ADAPTER_CONFIG, exc) from None
    try:
        weights = load_file(str(path / ckpt.ADAPTER_WEIGHTS), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for a truncated file
        raise unreadable(ckpt.ADAPTER_WEIGHTS, exc) from None
    optimizer = optimizer_problem = None
    trainer_state = None
    if (path / ckpt.TRAINER_STATE).exists():
        try:
            trainer_state = ckpt.read_trainer_state(path)
        except (OSError, ValueError) as exc:
            raise unreadable(ckpt.TRAINER_STATE, exc) from None
    torn = ckpt.wrong_sizes(path, trainer_state or {})
    if torn:
        raise unreadable(
            torn[0],
            "not the size trainer_state.json recorded (torn: not yet on disk when the machine stopped)",
        )
    missing = ckpt.missing_files(path, trainer_state or {})
    if [name for name in missing if name != ckpt.OPTIMIZER]:
        raise unreadable(missing[0], "missing: the trainer stopped before this step was complete")
    if missing:
        # The optimizer state follows the step's answer: the adapter was published (served under its
        # name), so the step stays; only its moments are lost, as with ART's adapter-only checkpoints.
        optimizer_problem = f"{path / ckpt.OPTIMIZER}: missing (the trainer stopped before it was written)"
    elif (path / ckpt.OPTIMIZER).exists():
        try:
            optimizer = torch.load(path / ckpt.OPTIMIZER, map_location=device)
        except Exception as exc:  # torch.load raises pickle, zip and runtime errors alike
            optimizer_problem = str(unreadable(ckpt.OPTIMIZER, exc))
    if trainer_state is None and optimizer is not None:
        raise unreadable(ckpt.TRAINER_STATE, "missing next to the optimizer state")
    return CheckpointState(adapter_config, weights, optimizer, trainer_state, optimizer_problem)


def adapter_of(model: Any, base_model: str) -> tuple[dict[str, torch.Tensor], Any]:
    """The adapter as SGLang's loader accepts it: the LoRA A/B weights only (on the model's device), and
    the peft config to save next to them (naming `base_model`, for inference)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    lora = {k: v.detach() for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}
    config = copy.deepcopy(model.peft_config["default"])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    return lora, config


def rng_state() -> dict[str, Any]:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    if "torch" in state:
        torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])
