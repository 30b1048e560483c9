"""Rank 0's checkpoint writes, with their disk work off the step's path.

A step's answer waits for what the server needs: the adapter, its config and trainer_state.json, written
and renamed into place (checkpoints.write_checkpoint), readable by the server from then on. A background
thread then fsyncs them (LateFile.sync_published: 0.05 s for the 74 MB adapter at 1.5B on a CPU test
host) and writes optimizer.pt (twice the adapter's size, about 0.3 s of serialisation and fsync at 1.5B)
from a host copy into space reserved before the rename (checkpoints.LateFile), while the next step
computes. Until then a power loss can tear the newest step: trainer_state.json records the published
files' sizes, and resume sets a step whose files differ aside for the one before, which the next write
waited for. trainer_state.json lists the complete step's files: a step whose optimizer.pt never arrived
(the trainer stopped first) is incomplete; its adapter was served under its name, so resume keeps it, with
a fresh optimizer. `settle` waits for the background work (the next checkpoint and the worker's exit call
it; not offload, which follows a step at once in shared mode), tries a failed one again, and raises if
that fails too."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..storage import checkpoints as ckpt
from .train_state import copy_optimizer_state

_ZIP_OVERHEAD = 4096  # bytes per tensor record in torch.save's zip, generously (the reserve is trimmed)


@dataclass
class _Pending:
    step: int
    file: ckpt.LateFile
    state: dict[str, Any]  # the optimizer state_dict, its tensors host copies
    copied: Callable[[], None]  # waits until the transfers into `state`'s host copies are done
    future: Future[None]

    def write(self) -> None:
        self.file.sync_published()  # the step itself on disk first
        self.copied()
        self.file.finish(lambda stream: torch.save(self.state, stream))


def save_adapter_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Write `weights` (contiguous host tensors) as safetensors, byte for byte what
    `safetensors.torch.save_file(weights, path, metadata={"format": "pt"})` writes: through the library's
    TensorSpec API, straight from the tensors' memory (save_file's own way to the same call spends ~6 ms
    in numpy per 392 tensors at 7B; before safetensors 0.8 it copied every tensor into bytes first)."""
    from safetensors import TensorSpec, serialize_file

    unfit = [
        name
        for name, t in weights.items()
        if t.device.type != "cpu" or not t.is_contiguous() or not t.numel()
    ]
    if unfit:  # the library reads raw memory: only whole, dense host tensors
        raise ValueError(f"not contiguous, non-empty host tensors: {unfit[:5]}")
    specs = {
        name: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in weights.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})  # `weights` keeps the memory alive


def _transfers_queued(devices: set[torch.device]) -> Callable[[], None]:
    """A wait for the work queued so far on `devices`' current streams (none for host tensors: their
    copies are done when queued)."""
    events = [torch.cuda.Event() for _ in devices]
    for event, device in zip(events, devices, strict=True):
        event.record(torch.cuda.current_stream(device))

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


class CheckpointWriter:
    """Writes checkpoints one after the other, each step's optimizer state in the background."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimizer-state")
        self._pending: _Pending | None = None
        self._buffers: list[torch.Tensor] = []
        self._waited = 0.0  # seconds settle(before_write=True) waited since the last write
        # Seconds of the last write's parts, in order: waiting for the previous checkpoint's background
        # work, the adapter's host copies, writing adapter_model.safetensors, the other published files and
        # optimizer.pt's reserve, and their rename into place.
        self.seconds: dict[str, float] = {}

    @property
    def unsettled_step(self) -> int | None:
        """The step whose optimizer state may not be on disk yet."""
        return self._pending.step if self._pending is not None else None

    def write(
        self,
        checkpoint_dir: Path,
        step: int,
        adapter: tuple[dict[str, torch.Tensor], Any],
        optimizer: dict[str, Any],
        trainer_state: dict[str, Any],
    ) -> Path:
        """Publish checkpoint `step`: `adapter` (LoRA tensors and peft config, saved as SGLang loads it)
        and `trainer_state` now, `optimizer` (a state_dict) in the background. Waits for the previous
        step's optimizer state first (`settle`)."""
        self.settle(before_write=True)
        settled = time.perf_counter()
        weights, config = adapter
        copied: list[torch.Tensor] = []
        state_copied: list[Callable[[], None]] = []

        def copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers, rest_copied = self._host_copies([*weights.values(), *tensors], len(weights))
            copied.extend(buffers)
            state_copied.append(rest_copied)
            return copied[len(weights) :]

        state = copy_optimizer_state(optimizer, copies)
        weights = dict(zip(weights, copied[: len(weights)], strict=True))
        reserve = sum(t.numel() * t.element_size() + _ZIP_OVERHEAD for t in copied[len(weights) :]) + 2**16
        late: list[ckpt.LateFile] = []
        filled: list[float] = []
        copies_done = time.perf_counter()

        def fill(tmp: Path) -> None:
            save_adapter_weights(weights, tmp / ckpt.ADAPTER_WEIGHTS)
            filled.append(time.perf_counter())
            config.save_pretrained(str(tmp))
            files = {
                **trainer_state,
                ckpt.COMPLETE_FILES_KEY: list(ckpt.CHECKPOINT_FILES),
                ckpt.SIZES_KEY: ckpt.file_sizes(tmp),
            }
            ckpt.write_json(tmp / ckpt.TRAINER_STATE, files)
            late.append(ckpt.LateFile(tmp, ckpt.OPTIMIZER, reserve))
            filled.append(time.perf_counter())

        try:
            path = ckpt.write_checkpoint(checkpoint_dir, step, fill)
        except BaseException:
            for file in late:
                file.close()
            raise
        self.seconds = {
            "wait": self._waited,
            "copy": copies_done - settled,
            "adapter": filled[0] - copies_done,
            "other_files": filled[1] - filled[0],
            "rename": time.perf_counter() - filled[1],
        }
        self._waited = 0.0
        pending = _Pending(step, late[0], state, state_copied[0], Future())
        pending.future = self._thread.submit(pending.write)
        self._pending = pending
        return path

    def _host_copies(
        self, tensors: list[torch.Tensor], first: int
    ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Copies of `tensors` in host buffers kept from step to step (pinned for a GPU's, so the copies are
        asynchronous transfers; fresh host memory costs page faults per step): the first `first` done on
        return, the rest once the returned wait returns. The rest (the optimizer state, twice the adapter)
        moves while the adapter is written; the step's later kernels, on the same streams, cannot change
        its sources before. The buffers are free again once the last write is settled."""
        if [(t.shape, t.dtype) for t in tensors] != [(b.shape, b.dtype) for b in self._buffers]:
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
        devices = {t.device for t in tensors if t.is_cuda}
        pairs = list(zip(self._buffers, tensors, strict=True))
        waits = []
        for part in (pairs[:first], pairs[first:]):
            for buffer, tensor in part:
                buffer.copy_(tensor.detach(), non_blocking=True)  # into pinned memory: queued, not waited for
            waits.append(_transfers_queued(devices))
        waits[0]()
        return list(self._buffers), waits[1]

    def settle(self, *, before_write: bool = False) -> None:
        """Wait until the last step is on disk, its optimizer state included; a failed write is tried once more here,
        and its error raised if it fails again (it is tried again at the next call). `before_write`: the next
        write's `wait` part counts this wait (the trainer settles on its own first, to word a failure)."""
        pending = self._pending
        if pending is None:
            return
        started = time.perf_counter()
        try:
            pending.future.result()
        except Exception:
            traceback.print_exc()
            pending.write()
        finally:
            if before_write:
                self._waited += time.perf_counter() - started
        pending.file.close()
        self._pending = None

    def close(self) -> None:
        """Settle, then stop the thread."""
        try:
            self.settle()
        finally:
            self._thread.shutdown(wait=True)
