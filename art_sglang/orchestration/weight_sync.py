"""How a new training step reaches the inference server (`SGLangConfig.weight_sync_method`).

Each strategy makes `<name>@<step>` servable in two phases: `prepare` needs no server (it runs right after
training, while in shared mode the server may still be down, so work like merging overlaps the handoff),
and `apply` runs once the server is back. Strategies change the server only through `InferenceService`'s
commands.

- `LoraSync` ("lora"): load the adapter into the running server; keep the newest `adapters_to_keep`
  names of the model loaded (requests in flight on an older step finish on it) and the ones rollouts
  lease (pipelined training), and unload older ones.
- `RestartSync` ("restart"): restart the server with the new adapter preloaded. `apply(...,
  may_restart=False)` loads it into the running server instead: at register, and when the shared-mode
  handoff has just started a fresh server process anyway.
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

from ..config import WeightSyncMethod
from ..serving.adapters import InferenceService
from ..serving.served_names import served_name, served_prefix
from ..storage.model_store import ModelStore
from .merge import merge_in_subprocess


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
        return served_name(self.name, self.step)

    @property
    def prefix(self) -> str:
        return served_prefix(self.name)


class WeightSync(ABC):
    """How a trained step reaches the servers (what each method allows: `serving_plan.SYNC_TRAITS`)."""

    method: WeightSyncMethod

    def __init__(self, service: InferenceService, adapters_to_keep: int):
        self.service = service
        self.adapters_to_keep = adapters_to_keep

    async def prepare(self, target: SyncTarget) -> None:  # noqa: B027 - most strategies need no prepare step
        """Work that needs no server; idempotent (it may run again before `apply`)."""

    @abstractmethod
    async def apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        """Make `target.inference_name` servable on the running server. `may_restart` is False where a
        restart would buy nothing (register; a server process started since the step was trained)."""


class LoraSync(WeightSync):
    method = "lora"

    async def apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        await self.service.add_adapter(target.inference_name, target.checkpoint)
        await self.service.keep_newest(target.prefix, self.adapters_to_keep)


class RestartSync(WeightSync):
    method = "restart"

    async def apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        await self.service.replace_adapters(
            target.prefix, target.inference_name, target.checkpoint, restart=may_restart
        )


class DiskSync(WeightSync):
    method = "disk"

    async def prepare(self, target: SyncTarget) -> None:
        if target.step == 0:
            return  # step 0's adapter is the identity (B = 0): the base weights are already right
        out = target.store.merged_dir(target.step)
        if not out.exists():
            log = target.store.logs_dir / "merge.log"
            await merge_in_subprocess(target.base_model, target.checkpoint, out, log)

    async def apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        merged = None if target.step == 0 else target.store.merged_dir(target.step)
        previous = await self.service.set_base_weights(merged)
        if previous is not None and previous != merged:
            await asyncio.to_thread(shutil.rmtree, previous, True)
        self.service.serve_alias(target.inference_name, target.prefix)


STRATEGIES: dict[str, type[WeightSync]] = {"lora": LoraSync, "restart": RestartSync, "disk": DiskSync}


def make_weight_sync(
    method: WeightSyncMethod, service: InferenceService, adapters_to_keep: int
) -> WeightSync:
    return STRATEGIES[method](service, adapters_to_keep)
