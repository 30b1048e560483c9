"""`UpdateGroup` (serving/servers/weight_push.py) without processes: the ranks it gives servers of
several tensor-parallel ranks (the reference engine has one, so the backend tests cannot show it), that it
is made once for the same servers and source, and made again, under a new name, when a server or the
source changed, with the old group left by the servers that still run."""

from __future__ import annotations

import os
from typing import Any

from art_sglang.serving.servers.replica import Server
from art_sglang.serving.servers.weight_push import GroupAddress, UpdateGroup


class FakeClient:
    def __init__(self, calls: list[tuple[Any, ...]], name: str) -> None:
        self.calls, self.name, self.closed = calls, name, False
        self.base_url = "http://127.0.0.1:30000"

    async def init_weights_update_group(self, address: str, port: int, offset: int, world: int, group: str,
                                        backend: str) -> None:  # fmt: skip
        self.calls.append(("init", self.name, offset, world, group, backend))

    async def destroy_weights_update_group(self, group: str) -> None:
        self.calls.append(("destroy", self.name, group))


class FakeSource:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls, self.group = calls, None

    async def join_group(self, address: GroupAddress) -> None:
        self.calls.append(("join", address.world_size, address.group_name, address.backend))
        self.group = address.group_name

    def in_group(self, group_name: str) -> bool:
        return self.group == group_name


def _server(calls: list[tuple[Any, ...]], name: str, ranks: int) -> Server:
    return Server(FakeClient(calls, name), name, None, None, ranks=ranks)  # type: ignore[arg-type]


async def test_ranks_follow_each_servers_tensor_parallel_size_and_the_group_is_made_once() -> None:
    calls: list[tuple[Any, ...]] = []
    source = FakeSource(calls)
    group = UpdateGroup("nccl")
    tp2, tp1 = _server(calls, "a", 2), _server(calls, "b", 1)
    assert await group.ready([tp2, tp1], source) == "art_weights_1"
    assert calls == [
        ("join", 4, "art_weights_1", "nccl"),
        ("init", "a", 1, 4, "art_weights_1", "nccl"),
        ("init", "b", 3, 4, "art_weights_1", "nccl"),
    ]
    calls.clear()
    assert await group.ready([tp2, tp1], source) == "art_weights_1"
    assert calls == []

    # Server b restarted (a new client; the old one closed): a new group, left by a that still runs.
    tp1.client.closed = True  # type: ignore[attr-defined]
    fresh = _server(calls, "b", 1)
    assert await group.ready([tp2, fresh], source) == "art_weights_2"
    assert calls == [
        ("destroy", "a", "art_weights_1"),
        ("join", 4, "art_weights_2", "nccl"),
        ("init", "a", 1, 4, "art_weights_2", "nccl"),
        ("init", "b", 3, 4, "art_weights_2", "nccl"),
    ]
    calls.clear()

    # The source restarted (it is in no group): a new group for the same servers.
    source.group = None
    assert await group.ready([tp2, fresh], source) == "art_weights_3"
    assert calls == [
        ("destroy", "a", "art_weights_2"),
        ("destroy", "b", "art_weights_2"),
        ("join", 4, "art_weights_3", "nccl"),
        ("init", "a", 1, 4, "art_weights_3", "nccl"),
        ("init", "b", 3, 4, "art_weights_3", "nccl"),
    ]


def test_a_process_joining_a_group_over_nccl_runs_nccl_as_sglang(monkeypatch: Any) -> None:
    """SGLang runs NCCL with cuMem off; a sender with it on fails NCCL's P2P setup with the server (H200,
    2026-11-28), so a process not yet running NCCL takes SGLang's settings before it joins."""
    from art_sglang import weight_group

    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    weight_group.run_nccl_as_sglang()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    monkeypatch.delenv("NCCL_CUMEM_ENABLE")
    weight_group.run_nccl_as_sglang()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
