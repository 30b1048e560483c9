"""Adapter leases: an unload asked for while a name is leased runs once its last lease ends (not before,
not on the rollout's own path), is called off if the name is wanted again, and is cancelled at close."""

from __future__ import annotations

import asyncio

from art_sglang.serving.adapter_leases import AdapterLeases


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_unload_waits_for_the_last_lease_of_its_name() -> None:
    unloaded: list[str] = []

    async def unload(name: str) -> None:
        unloaded.append(name)

    leases = AdapterLeases(unload)
    loads: list[str] = []

    async def load() -> None:
        loads.append("m@0")

    async with leases.lease("m@0", load):
        async with leases.lease("m@0", None):
            assert leases.held("m@0") and leases.names() == {"m@0"}
            leases.unload_when_free("m@0")
        await _settle()
        assert unloaded == [] and leases.held("m@0")  # one lease still holds it
    await _settle()
    assert unloaded == ["m@0"] and loads == ["m@0"] and not leases.held("m@0") and leases.names() == set()

    async with leases.lease("m@1", None):  # no unload was asked: none runs
        pass
    await _settle()
    assert unloaded == ["m@0"]


async def test_a_name_wanted_again_keeps_it_and_close_cancels_a_running_unload() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    unloaded: list[str] = []

    async def unload(name: str) -> None:
        started.set()
        await release.wait()
        unloaded.append(name)

    leases = AdapterLeases(unload)
    async with leases.lease("m@2", None):
        leases.unload_when_free("m@2")
        leases.wanted("m@2")  # served again before the lease ended
    await _settle()
    assert not started.is_set()

    async with leases.lease("m@3", None):
        leases.unload_when_free("m@3")
    await asyncio.wait_for(started.wait(), 5)
    await leases.close()  # the servers are stopping: the unload in flight is cancelled, not left running
    assert unloaded == [] and all(t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())


async def test_a_failed_unload_is_logged_not_raised(caplog) -> None:
    async def unload(name: str) -> None:
        raise RuntimeError("server gone")

    leases = AdapterLeases(unload)
    async with leases.lease("m@4", None):
        leases.unload_when_free("m@4")
    await _settle()
    assert "unloading m@4 after its last lease ended failed: server gone" in caplog.text
