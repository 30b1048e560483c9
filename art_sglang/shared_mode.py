"""`GpuHandoff`: who holds the GPU while the trainer works, in shared mode (one GPU for both).

- "sleep": SGLang's `release_memory_occupation` frees the server's GPU memory (weights and KV cache) and
  `resume_memory_occupation` restores it; no process restart. Needs the server started with
  `--enable-memory-saver --enable-weights-cpu-backup` (without them SGLang answers 200 and frees nothing),
  which the backend turns on. Measured on an H100 with a 1.5B model: 1.1-1.2 s to free (the CPU backup
  copies the weights to host memory), 0.4 s to resume.
- "restart": stop the server and start it again after training (72-197 s on SGLang, but it needs nothing
  from the server and always returns the GPU).
- "none": split mode and CPU: server and trainer never compete; the server keeps serving.

In both shared strategies new requests wait in the gateway meanwhile, requests in flight finish first,
and the trainer offloads its weights before the server takes the GPU back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .inference import InferenceService

HandoffStrategy = Literal["none", "sleep", "restart"]


class Offloadable(Protocol):
    def is_alive(self) -> bool: ...
    async def offload(self) -> None: ...
    async def reload(self) -> None: ...


@dataclass
class TrainerTurn:
    """What a turn did: `timings` (`time/gpu_release_s`, `time/gpu_resume_s`) and, once it ended, whether
    it started a fresh server process (`restarted_server`)."""

    timings: dict[str, float] = field(default_factory=dict)
    restarted_server: bool = False


class GpuHandoff:
    """`async with handoff.trainer_turn(trainer) as turn:` gives the trainer the GPU for the block and then
    gives it back to the server (if the server was serving before). A trainer that is not running when
    the turn begins may be started inside the block; whichever trainer runs at the end is offloaded."""

    def __init__(self, strategy: HandoffStrategy, service: InferenceService):
        self.strategy = strategy
        self.service = service

    @asynccontextmanager
    async def trainer_turn(self, trainer: Offloadable) -> AsyncIterator[TrainerTurn]:
        turn = TrainerTurn()
        if self.strategy == "none":
            yield turn
            return
        async with self.service.holding():
            serving = self.service.serving
            started = time.monotonic()
            if serving:
                if self.strategy == "sleep":
                    await self.service.release_memory()
                else:
                    await self.service.stop()
            if trainer.is_alive():
                await trainer.reload()
            turn.timings["time/gpu_release_s"] = time.monotonic() - started
            try:
                yield turn
            finally:
                started = time.monotonic()
                try:
                    if trainer.is_alive():
                        await trainer.offload()
                finally:
                    if serving:
                        if self.strategy == "sleep":
                            turn.restarted_server = await self.service.resume_memory()
                        else:
                            turn.restarted_server = await self.service.start()
                turn.timings["time/gpu_resume_s"] = time.monotonic() - started
