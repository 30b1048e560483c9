"""The process group that carries weights from the trainer to inference servers (SGLang 0.5.17's
`/init_weights_update_group` + `/update_weights_from_distributed`): rank 0 is the sender, the servers'
ranks follow from their `rank_offset`. Joined as SGLang's `init_custom_process_group` does (the TCP store
torch's rendezvous makes, hosted by the sender, prefixed with the group's name; torch's own group helper),
so a group made here meets SGLang's ranks; no default process group is needed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .sglang_env import SGLANG_NCCL_ENV


def join(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    *,
    backend: str = "nccl",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """This process's member of the group; returns once every rank has joined (rank 0 hosts the
    rendezvous). Raises what torch raises when the others do not come within `timeout_s`."""
    if backend == "nccl":
        run_nccl_as_sglang()
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store torch's TCP rendezvous makes, made here: under torch's launcher (a trainer of several ranks)
    # the rendezvous would connect to the launcher's store as a client instead of hosting this one.
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
    )
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    # Group ranks are global ranks here (the helper records them only for groups of a default group).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def run_nccl_as_sglang() -> None:
    """Give this process's NCCL the settings SGLang's servers run it with (`SGLANG_NCCL_ENV`), which NCCL
    reads at its first use here. RuntimeError if NCCL already runs here with other settings: such a process
    must be started with them (the backend starts its trainer so)."""
    wrong = {name: value for name, value in SGLANG_NCCL_ENV.items() if os.environ.get(name) != value}
    if not wrong:
        return
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        settings = " ".join(f"{name}={value}" for name, value in wrong.items())
        raise RuntimeError(
            f"NCCL already runs in this process without {settings}, which SGLang's servers run it with, so a "
            f"weight-update group with them cannot connect: start this process with {settings}"
        )
    os.environ.update(wrong)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Send `tensor` from rank 0 to every rank of `group` (on the others: receive into it)."""
    dist.broadcast(tensor, src=0, group=group)


def leave(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
