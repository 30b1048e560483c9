"""The weight-update groups a reference server has joined (`/init_weights_update_group`), by name, and
one broadcast from a group's rank 0 received as named tensors (`/update_weights_from_distributed`). A
server's rank is the request's `rank_offset` (one rank per server here: no tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from art_sglang import named_tensors, weight_group
from art_sglang.named_tensors import LoadFormat, NamedTensors


@dataclass(frozen=True)
class GroupTransfer:
    """The tensors of one broadcast, as `/update_weights_from_distributed` announces them."""

    group_name: str
    names: list[str]
    dtypes: list[str]  # torch's names: "bfloat16", "float32"
    shapes: list[list[int]]
    load_format: LoadFormat = None


class UpdateGroups:
    def __init__(self) -> None:
        self._groups: dict[str, dist.ProcessGroup] = {}

    def __contains__(self, group_name: str) -> bool:
        return group_name in self._groups

    def names(self) -> list[str]:
        return list(self._groups)

    def join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join as rank `rank_offset`; returns when every rank has joined."""
        self._groups[group_name] = weight_group.join(
            master_address, master_port, rank_offset, world_size, group_name, backend=backend
        )

    def leave(self, group_name: str) -> bool:
        """False if no such group was joined."""
        group = self._groups.pop(group_name, None)
        if group is None:
            return False
        weight_group.leave(group)
        return True

    def receive(self, transfer: GroupTransfer) -> NamedTensors:
        """The broadcast's tensors: one broadcast per tensor, or one of the flattened bucket."""
        group = self._groups[transfer.group_name]
        empty = [
            (name, torch.empty(shape, dtype=_dtype(dtype)))
            for name, dtype, shape in zip(transfer.names, transfer.dtypes, transfer.shapes, strict=True)
        ]
        if transfer.load_format is None:
            for _, tensor in empty:
                weight_group.broadcast(group, tensor)
            return empty
        bucket = named_tensors.flatten(empty)
        weight_group.broadcast(group, bucket["flattened_tensor"])
        return named_tensors.unflatten(bucket)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
