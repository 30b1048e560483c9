"""Inference replicas on the nodes of a Ray cluster (`SGLangBackend(cluster=...)`). Only `ClusterConfig`
is imported here: Ray itself is imported by `remote` and `host`, which load only when a cluster is used."""

from .config import ClusterConfig

__all__ = ["ClusterConfig"]
