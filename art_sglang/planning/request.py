"""`BackendRequest`: what SGLangBackend was asked for, checked and frozen when the backend is made (its
keyword arguments are sugar over it). `make_plan` turns it, the first model's settings and the GPUs found
into the `ServingPlan`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ClusterConfig, CudaMpsMode, DeviceConfig, SGLangConfig, SharedStrategy, TrainerConfig
from .config_checks import check_request
from .devices import GPU_FIELDS, DeviceLayout, EngineChoice


@dataclass(frozen=True)
class BackendRequest:
    """`devices`: the GPUs asked for, in the one form `device_request` makes of SGLangBackend's GPU
    arguments; `layout`: a finished layout instead (tests force shared mode on CPU with it); `cluster`: the
    replicas run on a Ray cluster's nodes; `gateway`:
    clients reach the servers through the adapter gateway."""

    sglang: SGLangConfig
    trainer: TrainerConfig
    devices: DeviceConfig | None = None
    engine: EngineChoice = "auto"
    layout: DeviceLayout | None = None
    shared_strategy: SharedStrategy = "sleep"
    cuda_mps: CudaMpsMode = "auto"
    cluster: ClusterConfig | None = None
    gateway: bool = True

    def __post_init__(self) -> None:
        check_request(
            self.sglang,
            self.trainer,
            shared_strategy=self.shared_strategy,
            cuda_mps=self.cuda_mps,
            engine=self.engine,
            layout=self.layout,
            devices=self.devices,
            cluster=self.cluster is not None,
        )

    @property
    def devices_given(self) -> bool:
        """Whether the GPUs are settled here (a model's `_internal_config` may then not name them)."""
        named = self.devices is not None and bool(self.devices.model_fields_set & set(GPU_FIELDS))
        return self.layout is not None or self.cluster is not None or named
