"""The eviction plugin entries without SGLang: `evict-without-gc` (no garbage collection starts while the wrapped
call builds its tuple per leaf, as SGLang 0.5.17's `RadixCache.evict` does, and the collector's state is kept)
and `evict-ahead` (the tokens a call asks for)."""

from __future__ import annotations

import dataclasses
import gc
import heapq
from types import SimpleNamespace
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


@dataclasses.dataclass
class EvictParams:
    """SGLang 0.5.17's `EvictParams` (mem_cache/base_prefix_cache.py), the fields `evict` reads."""

    num_tokens: int = 0
    swa_num_tokens: int = 0


def test_evict_ahead_frees_a_share_of_the_pool_per_call() -> None:
    """`evict-ahead`: a call for fewer tokens than 1/64 of the pool asks for that share (one call then serves
    the next few hundred decode steps); larger calls, and calls for nothing, go through as they are."""
    [(target, hook)] = backports.BACKPORTS["evict-ahead"].hooks
    assert target == "sglang.srt.mem_cache.radix_cache.RadixCache.evict"
    assert backports.BACKPORTS["evict-ahead"].default
    cache = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(size=2_400_000))
    asked: list[EvictParams] = []

    def evict(self: Any, params: EvictParams) -> int:
        assert self is cache
        asked.append(params)
        return params.num_tokens

    floor = 2_400_000 // 64
    assert hook(evict, cache, EvictParams(num_tokens=128)) == floor
    assert hook(evict, cache, EvictParams(num_tokens=floor + 1, swa_num_tokens=7)) == floor + 1
    assert hook(evict, cache, EvictParams(num_tokens=0)) == 0
    assert [(p.num_tokens, p.swa_num_tokens) for p in asked] == [(floor, 0), (floor + 1, 7), (0, 0)]
