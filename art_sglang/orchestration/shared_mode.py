"""`GpuHandoff`: who holds the GPU while the trainer works, in shared mode (one GPU for both).

- "sleep": SGLang's `release_memory_occupation` frees server memory and `resume_memory_occupation`
  restores it; no process restart. What is freed follows the backend's `SharedPlan` (gpu_budget.py):
  the KV cache alone while the trainer keeps its model on the GPU (both copies of the base weights fit;
  raw SGLang 0.5.17 on an H100: 0.04 s + 0.02 s), or the weights too, copied to host memory, while the
  trainer moves to host memory between steps (a 1.5B model: 1.1-1.2 s to free, 0.4 s to resume on the
  server side alone). Needs `--enable-memory-saver` (and `--enable-weights-cpu-backup` for weights):
  without them SGLang answers 200 and frees nothing; the backend turns them on.
- "restart": stop the server and start it again after training (72-197 s on SGLang, but it needs nothing
  from the server and always returns the GPU).
- "none": split mode and CPU: server and trainer never compete; the server keeps serving.

In both shared strategies new requests wait in the gateway meanwhile, requests in flight finish first,
and the trainer gives back the GPU memory it does not keep before the server takes it back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..planning.serving_plan import HandoffStrategy
from ..serving.adapters import InferenceService
from ..serving.sglang_api import KV_CACHE_TAG


class Offloadable(Protocol):
    def is_alive(self) -> bool: ...
    async def offload(self, *, keep_weights: bool = False) -> float: ...
    async def reload(self, *, min_free_bytes: float = 0.0, timeout_s: float = 10.0) -> dict[str, float]: ...


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

    def __init__(
        self,
        strategy: HandoffStrategy,
        service: InferenceService,
        release: Literal["kv_cache", "all"] = "all",
    ):
        self.strategy = strategy
        self.service = service
        self.release = release
        # Free device memory the trainer saw after the first release; later turns wait until the driver
        # shows most of it again before the trainer allocates.
        self._free_after_release = 0.0

    @property
    def trainer_keeps_weights(self) -> bool:
        """Whether the trainer's model stays on the GPU while the server serves."""
        return self.strategy == "none" or (self.strategy == "sleep" and self.release == "kv_cache")

    @asynccontextmanager
    async def trainer_turn(self, trainer: Offloadable) -> AsyncIterator[TrainerTurn]:
        turn = TrainerTurn()
        if self.strategy == "none":
            yield turn
            return
        servers = self.service.servers
        async with self.service.holding():
            serving = servers.serving
            started = time.monotonic()
            if serving:
                if self.strategy == "sleep":
                    await servers.release_memory([KV_CACHE_TAG] if self.release == "kv_cache" else None)
                else:
                    await servers.stop()
            if trainer.is_alive():
                seen = await trainer.reload(min_free_bytes=0.9 * self._free_after_release if serving else 0.0)
                if serving and not self._free_after_release:
                    self._free_after_release = seen.get("free_bytes", 0.0)
            turn.timings["time/gpu_release_s"] = time.monotonic() - started
            try:
                yield turn
            finally:
                started = time.monotonic()
                try:
                    if trainer.is_alive():
                        await trainer.offload(keep_weights=self.trainer_keeps_weights)
                finally:
                    if serving:
                        if self.strategy == "sleep":
                            turn.restarted_server = await servers.resume_memory()
                        else:
                            turn.restarted_server = await servers.start()
                turn.timings["time/gpu_resume_s"] = time.monotonic() - started
