"""`ServingPlan`: what a backend serves and trains with, made once before anything starts — the device
layout, the final server settings of each replica, the GPU handoff and what it releases, whether CUDA MPS
is tried, and the weight-sync method (`make_plan` makes it). The backend assembles its parts from it;
nothing changes it after (it and the settings inside it are frozen)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..config import ClusterConfig, SGLangConfig, WeightSyncMethod
from ..sglang_env import SGLANG_NCCL_ENV
from .devices import DeviceLayout

# Who holds the one GPU while the trainer works (shared_mode.GpuHandoff); "none" where they never compete.
HandoffStrategy = Literal["none", "sleep", "restart"]


@dataclass(frozen=True)
class SyncTraits:
    """What a weight-sync method allows, known before anything starts."""

    # An older step's adapter can be loaded beside the newest (on request, for a rollout's lease).
    serves_older_steps: bool = True
    # Older steps stay loaded while newer ones are published, so rollouts can pipeline with training.
    keeps_older_steps: bool = False
    # Several models can share the servers.
    several_models: bool = True
    # Rollouts in flight go on across a publish (continued on the new weights), so they can pipeline with
    # training though older steps are not kept.
    updates_in_flight: bool = False


SYNC_TRAITS: dict[WeightSyncMethod, SyncTraits] = {
    "lora": SyncTraits(keeps_older_steps=True),
    "restart": SyncTraits(),
    # Merged weights hold one step of one model: an older adapter on top would be wrong.
    "disk": SyncTraits(serves_older_steps=False, several_models=False),
    # The trainer's merged weights pushed from memory: the same one step of one model, rollouts in flight
    # continued on the new weights by the gateway (docs/merged-rollouts.md).
    "merged": SyncTraits(serves_older_steps=False, several_models=False, updates_in_flight=True),
}


class FrozenSGLangConfig(SGLangConfig):
    """Server settings that can no longer be changed."""

    model_config = ConfigDict(frozen=True)


class ReplicaPlan(BaseModel):
    """One server replica: its GPUs (as its `CUDA_VISIBLE_DEVICES` names them) and its settings."""

    model_config = ConfigDict(frozen=True)

    gpu_ids: tuple[str, ...]
    # configs[k]: the settings to start with while k other replicas run on the same GPUs. SGLang sizes
    # its memory as mem_fraction_static of the memory free when it starts: with k others each holding the
    # share f of the GPU, f / (1 - k*f) of what they left is the same share f of the whole GPU.
    configs: tuple[FrozenSGLangConfig, ...]


class ServingPlan(BaseModel):
    """The frozen plan (see the module docstring)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    layout: DeviceLayout
    server_config: FrozenSGLangConfig  # a replica's settings when it is alone on its GPUs
    # The settings as the user and the first model asked, before they were fitted: a later model may ask
    # for nothing else (one server serves every model of a backend).
    requested_config: FrozenSGLangConfig
    replicas: tuple[ReplicaPlan, ...]
    training_gpu_ids: tuple[str, ...]
    handoff: HandoffStrategy
    release: Literal["kv_cache", "all"]  # what a "sleep" handoff releases
    cuda_mps: bool  # start a CUDA MPS daemon for the co-resident server and trainer
    weight_sync: WeightSyncMethod
    cluster: ClusterConfig | None = None  # the replicas run as actors on a Ray cluster's nodes

    @property
    def routed(self) -> bool:
        """Whether requests reach the replicas through SGLang's router: with several, and always on a
        cluster (a node that dies leaves the router, whatever the number)."""
        return len(self.replicas) > 1 or self.cluster is not None

    @property
    def weight_update_group(self) -> Literal["nccl", "gloo"] | None:
        """How merged weights reach the servers (weight_sync="merged"): over a weight-update group of this
        backend ("gloo" where the trainer has no GPU), or None: as tensors (CUDA IPC handles; shared memory
        on CPU) to the one server that shares the trainer's device (never a Ray node's)."""
        if self.cluster is None and self.layout.mode != "split" and len(self.replicas) == 1:
            return None
        return "nccl" if self.layout.training_gpus else "gloo"

    @property
    def trainer_env(self) -> dict[str, str]:
        """What the trainer's environment must hold from its start: NCCL run as SGLang runs it, where the
        trainer broadcasts weights to the servers (a trainer of several ranks uses NCCL before it joins)."""
        return dict(SGLANG_NCCL_ENV) if self.weight_update_group == "nccl" else {}


def frozen_config(config: SGLangConfig) -> FrozenSGLangConfig:
    """A frozen copy of `config` that knows which settings were set."""
    return FrozenSGLangConfig.model_validate(config.model_dump(exclude_unset=True))
