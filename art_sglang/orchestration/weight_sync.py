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
- `MergedSync` ("merged", opt-in; docs/merged-rollouts.md): the trainer merges its adapter into its
  never-written base weights and pushes them from memory into the servers (`InferenceService.push_weights`:
  generation paused, buckets, the version with the last); `<name>@<step>` is served by the base slot once
  the servers report that version. As with "disk", only the newest name is served; one model per server.
"""

from __future__ import annotations

import asyncio
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import WeightSyncMethod
from ..errors import ServerRequestError, TrainerError
from ..serving.adapters import InferenceService
from ..serving.served_names import served_name, served_prefix
from ..serving.servers.weight_push import BucketSink, GroupAddress
from ..storage.model_store import ModelStore
from ..training.process import TrainerProcess
from .merge import merge_in_subprocess


@dataclass
class SyncTarget:
    """What to publish: model `name`'s adapter of `step` at `checkpoint`."""

    name: str
    step: int
    checkpoint: Path
    store: ModelStore
    base_model: str
    trainer: TrainerProcess | None = None  # holds the step's weights in memory (merged sync pushes them)

    @property
    def inference_name(self) -> str:
        return served_name(self.name, self.step)

    @property
    def prefix(self) -> str:
        return served_prefix(self.name)


class WeightSync(ABC):
    """How a trained step reaches the servers (what each method allows: `serving_plan.SYNC_TRAITS`)."""

    method: WeightSyncMethod

    def __init__(self, service: InferenceService, adapters_to_keep: int, bucket_bytes: int):
        self.service = service
        self.adapters_to_keep = adapters_to_keep
        self.bucket_bytes = bucket_bytes

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


class TrainerWeights:
    """A model's trainer as the source of the weights pushed into the servers (`WeightsSource`): its
    merged weights, named `<name>@<the trainer's step>`. A trainer that is not running is started first
    (it resumes its newest complete checkpoint), so a server restarted after the trainer died gets them."""

    # named_tensors.FLATTENED_BUCKET, spelled out here: that module imports torch.
    load_format = "flattened_bucket"

    def __init__(self, trainer: TrainerProcess, name: str, bucket_bytes: int) -> None:
        self._trainer = trainer
        self._name = name
        self._bucket_bytes = bucket_bytes
        self.step: int | None = None  # of the weights pushed last

    async def version(self) -> str:
        if not self._trainer.is_alive() or self._trainer.step is None:
            await self._trainer.start()
        assert self._trainer.step is not None
        self.step = self._trainer.step
        return served_name(self._name, self.step)

    async def push(self, sink: BucketSink, group_name: str | None) -> None:
        async def checked(bucket: dict[str, Any], last: bool, step: int) -> bool:
            # Before the first bucket is loaded: the trainer may have trained on since `version` was read.
            if step != self.step:
                raise TrainerError(f"the trainer holds step {step}'s weights, not step {self.step}'s")
            return await sink(bucket, last)

        await self._trainer.push_merged(
            checked, max_bytes=self._bucket_bytes, load_format=self.load_format, group_name=group_name
        )

    async def join_group(self, address: GroupAddress) -> None:
        await self._trainer.join_update_group(
            address.master_address, address.master_port, address.world_size, address.group_name,
            address.backend, address.timeout_s,
        )  # fmt: skip

    def in_group(self, group_name: str) -> bool:
        return self._trainer.is_alive() and self._trainer.update_group == group_name


class MergedSync(WeightSync):
    method = "merged"

    async def apply(self, target: SyncTarget, *, may_restart: bool) -> None:
        if target.trainer is None:
            raise TrainerError(f"{target.inference_name}: merged weights come from a running trainer")
        source = TrainerWeights(target.trainer, target.name, self.bucket_bytes)
        await self.service.push_weights(source, target.prefix)
        if source.step != target.step:  # a trainer restarted meanwhile resumed another checkpoint
            raise ServerRequestError(
                f"{target.inference_name} could not be served: the trainer holds step {source.step}, which "
                "the servers now serve"
            )


STRATEGIES: dict[str, type[WeightSync]] = {
    "lora": LoraSync,
    "restart": RestartSync,
    "disk": DiskSync,
    "merged": MergedSync,
}


def make_weight_sync(
    method: WeightSyncMethod, service: InferenceService, adapters_to_keep: int, bucket_bytes: int
) -> WeightSync:
    return STRATEGIES[method](service, adapters_to_keep, bucket_bytes)
