"""Inference replicas on the nodes of a Ray cluster (`SGLangBackend(cluster=ClusterConfig(...))`): the Ray
side only. Ray itself is imported by `remote` and `host`, which load only when a cluster is used."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ClusterConfig
    from .remote import RayCluster


def ray_cluster(config: ClusterConfig) -> RayCluster:
    """The cluster `ServerGroup` places the replicas of `config` on (Ray, an optional extra, imported now)."""
    from .remote import RayCluster

    return RayCluster(config)
