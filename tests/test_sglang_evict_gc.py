"""The `evict-without-gc` plugin entry without SGLang: no garbage collection starts while the wrapped call
builds its tuple per leaf (as SGLang 0.5.17's `RadixCache.evict` does), and the collector's state is kept."""

from __future__ import annotations

import gc
import heapq
from typing import Any

from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports

LEAVES = 10_000  # a full 1.5B pool's evictable leaves on an H200, roughly


def test_no_collection_starts_inside_the_wrapped_evict() -> None:
    [(target, hook)] = backports.BACKPORTS["evict-without-gc"].hooks
    assert target == "sglang.srt.mem_cache.radix_cache.RadixCache.evict"
    leaves = [[n] for n in range(LEAVES)]
    inside = False
    started_inside: list[int] = []

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and inside:
            started_inside.append(info["generation"])

    def evict(leaves: list[list[int]]) -> int:
        """RadixCache.evict's allocations: a (priority, node) tuple per leaf, heapified, the oldest popped."""
        nonlocal inside
        inside = True
        try:
            heap = [(leaf[0], leaf) for leaf in leaves]
            heapq.heapify(heap)
            return heapq.heappop(heap)[0]
        finally:
            inside = False

    gc.callbacks.append(watch)
    try:
        assert evict(leaves) == 0 and started_inside  # unwrapped, young collections run mid-build
        started_inside.clear()
        assert hook(evict, leaves) == 0 and started_inside == [] and gc.isenabled()
        gc.disable()
        try:
            assert hook(evict, leaves) == 0 and not gc.isenabled()  # a caller's choice is left alone
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(watch)
