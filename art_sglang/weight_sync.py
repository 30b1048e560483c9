"""How a new training step reaches the inference server (`SGLangConfig.weight_sync_method`).

Each strategy makes `<name>@<step>` servable in two phases: `prepare` runs right after training, while in
shared mode the server may still be down (so work that needs no server, like merging, overlaps the
handoff, and a restart can preload the new adapter), and `apply` runs once the server is back.

- `LoraSync` ("lora"): load the adapter into the running server; keep the newest `adapters_to_keep`
  names of the model loaded (requests in flight on an older step finish on it) and unload older ones.
- `RestartSync` ("restart"): restart the server with the new adapter preloaded (no restart of its own
  when the shared-mode handoff already started the server after `prepare`).
- `DiskSync` ("disk"): merge the adapter into the base weights on CPU, `update_weights_from_disk`, and
  serve `<name>@<step>` by the base slot (the gateway rewrites the name to the base model id). Older steps
  are gone with the old weights, so only the newest name is served; one model per server.
"""

from __future__ import annotations

import asyncio
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from .config import WeightSyncMethod
from .inference import InferenceService
from .merge import merge_in_subprocess
from .model_store import ModelStore


@dataclass
class SyncTarget:
    """What to publish: model `name`'s adapter of `step` at `checkpoint`."""

    name: str
    step: int
    checkpoint: Path
    store: ModelStore
    base_model: str

    @property
    def inference_name(self) -> str:
        return f"{self.name}@{self.step}"

    @property
    def prefix(self) -> str:
        return f"{self.name}@"


class WeightSync(ABC):
    method: WeightSyncMethod

    def __init__(self, service: InferenceService, adapters_to_keep: int):
        self.service = service
        self.adapters_to_keep = adapters_to_keep

    async def prepare(self, target: SyncTarget) -> None:  # noqa: B027 - most strategies need no prepare step
        """Work done before the server is back (shared mode) or while it keeps serving (split mode)."""

    @abstractmethod
    async def apply(self, target: SyncTarget) -> None:
        """Make `target.inference_name` servable on the running server."""

    async def publish(self, target: SyncTarget) -> None:
        """Both phases, for a server that is up (register, resume)."""
        await self.prepare(target)
        await self.apply(target)


class LoraSync(WeightSync):
    method = "lora"

    async def apply(self, target: SyncTarget) -> None:
        await self.service.load(target.inference_name, target.checkpoint)
        await self.service.keep_newest(target.prefix, self.adapters_to_keep)


class RestartSync(WeightSync):
    method = "restart"

    def __init__(self, service: InferenceService, adapters_to_keep: int):
        super().__init__(service, adapters_to_keep)
        self._starts_at_prepare = -1

    async def prepare(self, target: SyncTarget) -> None:
        # A restart ends every request in flight, so older steps need not stay loaded.
        adapters = self.service.adapters
        for name in [n for n in adapters if n.startswith(target.prefix)]:
            del adapters[name]
        adapters[target.inference_name] = target.checkpoint
        self._starts_at_prepare = self.service.starts

    async def apply(self, target: SyncTarget) -> None:
        if not self.service.process.is_alive():
            await self.service.start()  # comes up with the adapter preloaded
        elif self.service.starts == self._starts_at_prepare:
            await self.service.hold()
            try:
                await self.service.restart()
            finally:
                await self.service.unhold()
        # else the shared-mode handoff started the server after prepare: the adapter is loaded already.

    async def publish(self, target: SyncTarget) -> None:
        # At register the server has just started: loading the adapter is enough, a restart would only
        # cost minutes on SGLang.
        await self.service.load(target.inference_name, target.checkpoint)


class DiskSync(WeightSync):
    method = "disk"

    async def prepare(self, target: SyncTarget) -> None:
        if target.step == 0:
            return  # step 0's adapter is the identity (B = 0): the base weights are already right
        out = target.store.merged_dir(target.step)
        if not out.exists():
            log = target.store.logs_dir / "merge.log"
            await merge_in_subprocess(target.base_model, target.checkpoint, out, log)

    async def apply(self, target: SyncTarget) -> None:
        service = self.service
        merged = None if target.step == 0 else target.store.merged_dir(target.step)
        if merged is not None and service.merged_weights != merged:
            await service.hold()
            try:
                if service.client is not None:
                    await service.client.update_weights_from_disk(str(merged))
                # The prefix cache holds keys/values computed with the old weights of the same slot.
                await service.flush_cache()
            finally:
                await service.unhold()
            old, service.merged_weights = service.merged_weights, merged
            if old is not None and old != merged:
                await asyncio.to_thread(shutil.rmtree, old, True)
        service.set_alias(target.inference_name, target.prefix)


STRATEGIES: dict[str, type[WeightSync]] = {"lora": LoraSync, "restart": RestartSync, "disk": DiskSync}


def make_weight_sync(
    method: WeightSyncMethod, service: InferenceService, adapters_to_keep: int
) -> WeightSync:
    return STRATEGIES[method](service, adapters_to_keep)
