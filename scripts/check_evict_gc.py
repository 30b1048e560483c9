"""Does SGLang's own `RadixCache.evict` set off CPython's full collections once the KV pool is full (CPU)?

Builds a real `RadixCache` over a real `TokenToKVPoolAllocator` (CPU tensors) filled like a full pool of GRPO
rollouts (per group one shared prompt and 8 answer leaves), beside a long-lived heap standing in for the
scheduler's own objects. Then serves waves of `--running` requests as SGLang's scheduler does with a full
pool: the groups' prompts are prefilled and the decode steps run, each reclaiming what it needs through
SGLang's `evict_from_tree_cache` (as `alloc_for_extend` and `check_decode_mem` do: the shortfall only), and
the finished answers are inserted, so the tree stays full. Each decode step also makes `--garbage`
short-lived objects. Full (generation 2) collections are counted with `gc.callbacks`; the evict calls
counted include the prefills'; a step's time includes, at a wave's end, its inserts and the next prefill.

`--backports NAMES` applies art_sglang's backports as the server does: `art_sglang_backports.register()` with
`ART_SGLANG_BACKPORTS=NAMES`, then SGLang's `HookRegistry.apply_hooks()` (`none`: SGLang as released). Without
it, SGLang as released, `evict-without-gc` and `evict-ahead` run, each in a fresh interpreter.

    PYTHONPATH=/path/to/sglang-0.5.17 python scripts/check_evict_gc.py --groups 1250
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

SGLANG_SITE = Path(__file__).resolve().parent.parent / "art_sglang" / "serving" / "servers" / "sglang_site"
VOCAB = 150_000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--groups", type=int, default=1250, help="prompts in the full tree (x answers = leaves)"
    )
    parser.add_argument("--answers", type=int, default=8, help="answer leaves per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=1100)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--running", type=int, default=128, help="requests decoding (tokens per step)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--heap", type=int, default=2_000_000, help="long-lived tracked objects")
    parser.add_argument("--garbage", type=int, default=300, help="short-lived objects per decode step")
    parser.add_argument("--backports", default=None, help="an ART_SGLANG_BACKPORTS value (none: as released)")
    return parser.parse_args()


def tokens(rng: int, count: int) -> array:
    """`count` token ids from a cheap deterministic generator (distinct first ids keep answers apart)."""
    return array("q", ((rng * 7919 + i * 104_729) % VOCAB for i in range(count)))


def run(args: argparse.Namespace) -> None:
    try:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as error:
        print(f"skipped: SGLang is not importable here ({error}); put its source on PYTHONPATH")
        return
    if args.backports != "none":
        os.environ["ART_SGLANG_BACKPORTS"] = args.backports
        sys.path.insert(0, str(SGLANG_SITE))
        import art_sglang_backports
        from sglang.srt.plugins.hook_registry import HookRegistry

        art_sglang_backports.register()
        HookRegistry.apply_hooks()

    groups_per_wave = args.running // args.answers
    wave_tokens = groups_per_wave * args.prompt_tokens + args.running * args.answer_tokens
    allocator = TokenToKVPoolAllocator(
        args.groups * (args.prompt_tokens + args.answers * args.answer_tokens) + wave_tokens,
        torch.int64,
        "cpu",
        None,
        need_sort=False,
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1
    )
    cache = RadixCache(params)
    waves = [0]

    def wave(decode_step: Callable[[], None]) -> None:
        """One wave of `running` requests: prefill of their groups' prompts, the decode steps, the finish."""
        first = waves[0] * groups_per_wave
        waves[0] += 1
        prompts = []
        for group in range(first, first + groups_per_wave):
            evict_from_tree_cache(cache, args.prompt_tokens)  # alloc_for_extend
            prompt = tokens(group, args.prompt_tokens), allocator.alloc(args.prompt_tokens)
            cache.insert(InsertParams(key=RadixKey(prompt[0]), value=prompt[1]))
            prompts.append(prompt)
        columns = []
        for _ in range(args.answer_tokens):
            decode_step()
            evict_from_tree_cache(cache, args.running)  # ScheduleBatch.check_decode_mem
            columns.append(allocator.alloc(args.running))
        answers = torch.stack(columns, dim=1)
        for request, answer in enumerate(answers):  # cache_finished_req
            prompt = prompts[request // args.answers]
            key = RadixKey(prompt[0] + tokens(VOCAB + first * args.running + request, args.answer_tokens))
            cache.insert(InsertParams(key=key, value=torch.cat((prompt[1], answer))))

    while allocator.available_size() >= wave_tokens:
        wave(lambda: None)
    heap = [[n] for n in range(args.heap)]
    gc.collect()
    leaves = len(cache.evictable_leaves)

    full: list[float] = []
    started = [0.0]
    inside = [False]  # within an evict call
    full_inside = [0]

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
                full_inside[0] += inside[0]
            else:
                full.append(time.perf_counter() - started[0])

    gc.callbacks.append(watch)
    evicts = 0
    evict = cache.evict

    def counted(*call_args: object, **kwargs: object) -> object:
        nonlocal evicts
        evicts += 1
        inside[0] = True
        try:
            return evict(*call_args, **kwargs)
        finally:
            inside[0] = False

    cache.evict = counted
    step_s: list[float] = []
    last = [time.perf_counter()]

    def decode_step() -> None:
        """Times the step before and makes this one's short-lived objects."""
        now = time.perf_counter()
        step_s.append(now - last[0])
        last[0] = now
        garbage = [[n] for n in range(args.garbage)]
        del garbage

    begin = time.perf_counter()
    while len(step_s) < args.steps:
        wave(decode_step)
    wall = time.perf_counter() - begin
    steps = len(step_s)
    gc.callbacks.remove(watch)
    step_s.sort()
    mean_full = sum(full) / len(full) if full else 0.0
    print(
        f"python {sys.version.split()[0]} backports {args.backports}: {leaves} leaves, "
        f"heap {args.heap} + {len(gc.get_objects()) - len(heap)} other tracked; {steps} steps, "
        f"{evicts} evict calls: {len(full)} full collections ({full_inside[0]} started in evict; {1000 * len(full) / steps:.1f} per 1000 steps, "
        f"{mean_full:.3f} s each); step mean {1000 * wall / steps:.2f} ms, "
        f"p50 {1000 * step_s[len(step_s) // 2]:.2f} ms, max {1000 * step_s[-1]:.0f} ms",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    if args.backports is not None:
        run(args)
        return
    if importlib.util.find_spec("sglang") is None:
        print("skipped: SGLang is not importable here; put its source on PYTHONPATH")
        return
    for names in ("none", "evict-without-gc", "evict-ahead"):
        subprocess.run([sys.executable, *sys.argv, "--backports", names], check=True)


if __name__ == "__main__":
    main()
