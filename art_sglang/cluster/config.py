"""`ClusterConfig`: where the inference replicas of a backend run when they run on a Ray cluster, and the
device layout of the head (this machine) that follows. Imports no Ray."""

from __future__ import annotations

import importlib.util

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConfigError
from ..planning.devices import DeviceLayout, EngineChoice, detect_gpus


class ClusterConfig(BaseModel):
    """Inference replicas as Ray actors on the nodes of a running Ray cluster (`ray start`). The backend,
    the gateway, SGLang's router, the trainer and the checkpoints stay on this machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(
        "auto", description="The Ray cluster to join (ray.init's address): 'auto' finds the local node's."
    )
    inference_replicas: int = Field(1, ge=1, description="Server replicas, each a Ray actor on some node.")
    gpus_per_replica: float = Field(
        1,
        ge=0,
        description="GPUs each replica holds (at least tensor_parallel_size; 0 for CPU test engines).",
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each replica needs besides its GPUs (to keep replicas on chosen nodes).",
    )
    adapter_dir: str | None = Field(
        None,
        description="Node-local folder the replicas write adapters into (a subfolder each); None = the node's "
        "temporary folder.",
    )
    shared_filesystem: bool = Field(
        False,
        description="Every node reads the checkpoint folder at the same path: adapters are loaded from it "
        "directly instead of being shipped.",
    )
    placement_timeout: float = Field(
        300.0, gt=0, description="Seconds a replica may wait for a node with room before its start fails."
    )


def cluster_layout(cluster: ClusterConfig, engine: EngineChoice, tensor_parallel_size: int) -> DeviceLayout:
    """The head's layout: every GPU of this machine trains, the inference replicas hold GPUs of the
    cluster's nodes (none here). The engine follows this machine's GPUs unless `engine` names one."""
    require_ray()
    found = detect_gpus()
    chosen = engine if engine != "auto" else ("sglang" if found.gpus else "reference")
    if chosen == "sglang" and cluster.gpus_per_replica < tensor_parallel_size:
        raise ConfigError(
            f"ClusterConfig(gpus_per_replica={cluster.gpus_per_replica:g}) is below tensor_parallel_size="
            f"{tensor_parallel_size}: each SGLang replica needs that many GPUs"
        )
    gpus = tuple(gpu.index for gpu in found.gpus) if chosen == "sglang" else ()
    where = f"{cluster.inference_replicas} inference replica(s) on the Ray cluster at {cluster.address!r}"
    return DeviceLayout(
        "split" if gpus else "cpu",
        chosen,
        (),
        gpus,
        f"{where}; this machine trains",
        tuple(gpu.cuda_id for gpu in found.gpus),
        replica_gpus=((),) * cluster.inference_replicas,
    )


def require_ray() -> None:
    """A `ConfigError` naming the extra to install where Ray is missing (looked up, not imported)."""
    try:
        installed = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: a `ray` module without a spec (or blocked, None)
        installed = False
    if not installed:
        raise ConfigError(
            "cluster= runs the inference replicas as Ray actors, and Ray is not installed in this "
            "environment: pip install 'art-sglang[ray]'"
        )
