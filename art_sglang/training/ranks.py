"""The trainer's data-parallel ranks: one worker process per training device, started by torch's elastic
launcher (`python -m torch.distributed.run`, which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
address in each worker's environment). Rank 0 talks to the backend and writes the checkpoints; every rank
trains its share of each optimizer step's sequences, and the ranks sum their gradients before the step,
so their weights stay equal and a step on N ranks is the step on one (up to float rounding).

With one rank (no launcher) every method is the single-process identity and nothing is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar

T = TypeVar("T")

# Between commands the other ranks wait for rank 0's next request for as long as rollouts take, and a
# hung step is bounded by the parent (TrainerConfig.step_timeout kills the whole tree): no collective
# needs a timeout of its own.
_WAIT = timedelta(days=365)


class Ranks:
    """This process's place among the trainer's ranks, and the collectives the training step needs."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0) -> None:
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self._compute: Any = None  # the group of the step's tensors: NCCL on GPUs, gloo on CPU
        self._control: Any = None  # gloo, for Python objects (requests, decisions, RNG state)
        self._device: Any = None

    @classmethod
    def from_environment(cls) -> Ranks:
        """The ranks torch's launcher describes in the environment; one rank when it did not start us.
        With GPUs, rank r uses the r-th GPU of the worker's CUDA_VISIBLE_DEVICES."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch
        import torch.distributed as dist

        ranks = cls(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]))
        if torch.cuda.is_available():
            ranks._device = torch.device("cuda", ranks.local_rank)
            torch.cuda.set_device(ranks._device)
            dist.init_process_group("nccl", device_id=ranks._device, timeout=_WAIT)
            ranks._control = dist.new_group(backend="gloo", timeout=_WAIT)
        else:
            ranks._device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=_WAIT)
            ranks._control = dist.group.WORLD
        ranks._compute = dist.group.WORLD
        return ranks

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T], size: Callable[[T], int]) -> list[T]:
        """This rank's part of `items`: the largest first, each to the rank with the least `size` so far
        (the lowest rank on ties), so every rank computes the same split; in the given order."""
        if self.world == 1:
            return list(items)
        loads = [0] * self.world
        mine = []
        for index in sorted(range(len(items)), key=lambda i: -size(items[i])):
            owner = min(range(self.world), key=loads.__getitem__)
            loads[owner] += size(items[index])
            if owner == self.rank:
                mine.append(index)
        return [items[i] for i in sorted(mine)]

    def sum_gradients(self, params: Sequence[Any], scalars: Sequence[float]) -> list[float]:
        """Sum every parameter's gradient (none counts as zeros) and `scalars` over the ranks, in one
        collective; returns the summed scalars."""
        if self.world == 1:
            return list(scalars)
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat(
            [g.reshape(-1).float() for g in grads]
            + [torch.tensor(list(scalars), dtype=torch.float32, device=grads[0].device)]
        )
        dist.all_reduce(flat, group=self._compute)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            param.grad = flat[offset : offset + grad.numel()].view_as(param).to(param.dtype)
            offset += grad.numel()
        return flat[offset:].tolist()

    def reduce(self, values: Sequence[float], op: Literal["sum", "min", "max"] = "sum") -> list[float]:
        """`values` combined over the ranks (element-wise)."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._device)
        dist.all_reduce(tensor, op=ops[op], group=self._compute)
        return tensor.tolist()

    def from_main(self, value: T) -> T:
        """Rank 0's `value` on every rank (the others pass anything, e.g. None)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self._control)
        return values

    def copy_from_main(self, tensors: Sequence[Any]) -> None:
        """Overwrite `tensors` with rank 0's values, in place."""
        if self.world == 1:
            return
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=0, group=self._compute)

    def align_rng(self) -> None:
        """Give every rank rank 0's torch generator state: the step's random row order must be the same
        on every rank, and dropout draws per rank."""
        if self.world == 1:
            return
        import torch

        torch.set_rng_state(self.from_main(torch.get_rng_state()))

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
