"""Rollout throughput of SGLang server replicas, and the prefix-cache hit rate each way of spreading
requests over them keeps. The same multi-turn workload (conversations of several turns, each group sharing
a long system prompt, on a LoRA adapter as rollouts during training are) runs on one replica alone, on two
replicas through the backend's gateway (which picks the replica itself: `serving.gateway.balancer`), and
through SGLang's router with cache-aware and with round-robin routing. The replicas are started once,
through the backend's `InferenceService` (the adapter loaded on both); each run starts from flushed prefix
caches.

    python scripts/bench_replicas.py --model /root/models/qwen2.5-1.5b-shape \\
        --sampling-backend pytorch --json replicas.json --markdown replicas.md    (2 GPUs)
    python scripts/bench_replicas.py --engine reference --model <tiny model> --conversations 4   (CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    device_name,
    environment,
    make_random_adapter,
    markdown_table,
    server_config,
    write_results,
)

from art_sglang.planning.devices import DeviceLayout
from art_sglang.planning.serving_plan import ReplicaPlan, ServingPlan, frozen_config
from art_sglang.serving.adapters import InferenceService
from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.replica_health import ReplicaRouter

ADAPTER = "bench@1"
INSTRUCTIONS = "You are an agent in a long game. Think about the board, then answer with one move. "


async def conversation(
    http: httpx.AsyncClient, url: str, model: str, task: int, game: int, args: argparse.Namespace
) -> tuple[int, int, int]:
    """One multi-turn rollout; (completion, prompt, cached prompt) tokens over its turns."""
    messages = [
        {"role": "system", "content": f"Task {task}. " + INSTRUCTIONS * args.prefix_repeats},
        {"role": "user", "content": f"Game {game}: your first move?"},
    ]
    completion = prompt = cached = 0
    for turn in range(args.turns):
        body = {"model": model, "lora_path": ADAPTER, "messages": messages, "max_tokens": args.max_tokens,
                "temperature": 1.0, "ignore_eos": True}  # fmt: skip
        response = await http.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        reply = response.json()
        usage = reply["usage"]
        completion += usage["completion_tokens"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        messages += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": f"Move {turn + 2}?"},
        ]
    return completion, prompt, cached


async def workload(url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    """All conversations at once against `url`; tokens/s and the share of prompt tokens served from cache."""
    # No cap on connections: httpx's default pool (100) would hold all but 100 conversations back.
    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, trust_env=False, limits=unlimited) as http:
        began = time.monotonic()
        totals = await asyncio.gather(
            *(
                conversation(http, url, model, game % args.tasks, game, args)
                for game in range(args.conversations)
            )
        )
        seconds = time.monotonic() - began
    completion, prompt, cached = (sum(column) for column in zip(*totals, strict=True))
    return {
        "seconds": round(seconds, 2),
        "completion_tokens": completion,
        "tokens_per_s": round(completion / seconds, 1),
        "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = server_config(args)
    placements = [("0",), ("1",)] if args.engine == "sglang" else [(), ()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    adapter = make_random_adapter(args.model, args.workdir / "adapter", rank=args.lora_rank)
    frozen = frozen_config(config)
    mode = "split" if args.engine == "sglang" else "cpu"
    layout = DeviceLayout(
        mode, args.engine, (0,), (), "bench", replica_gpus=((0,), (1,)) if mode == "split" else ((), ())
    )
    plan = ServingPlan(
        layout=layout,
        server_config=frozen,
        requested_config=frozen,
        replicas=tuple(ReplicaPlan(gpu_ids=gpus, configs=(frozen,)) for gpus in placements),
        training_gpu_ids=(),
        handoff="none",
        release="all",
        cuda_mps=False,
        weight_sync=frozen.weight_sync_method,
    )
    service = InferenceService(plan, args.model, log_path=args.workdir / "server.log", use_gateway=False)
    python = config.resolved_server_python() if args.engine == "sglang" else sys.executable
    round_robin = ReplicaRouter(python=python, policy="round_robin", log_path=args.workdir / "router-rr.log")
    # The gateway as the backend sets it up (prefill sharing's default lead included), without its key.
    gateway = AdapterGateway(None, share_lead=config.share_prefill_lead_ms / 1000, replicated=True)
    runs = []
    try:
        began = time.monotonic()
        await service.servers.start()
        started = time.monotonic() - began
        await service.add_adapter(ADAPTER, adapter)
        await round_robin.start()
        for process in service.processes:
            await round_robin.add_worker(process.base_url)
        assert service.router is not None
        gateway.start()
        gateway.set_served([ADAPTER], [args.model])
        gateway.set_upstream([p.base_url for p in service.processes], health=service.router.base_url)
        targets = [
            ("1 replica (GPU 0)", service.processes[0].base_url),
            ("2 replicas, the backend's gateway", gateway.base_url),
            ("2 replicas, router: cache-aware routing", service.router.base_url),
            ("2 replicas, router: round-robin routing", round_robin.base_url),
        ]
        for label, url in targets:
            # Kernels compiled and the adapter touched on every replica before the clock runs.
            await workload(
                url, args.model, argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 1})
            )
            await service.servers.flush_cache()
            runs.append({"setup": label, **(await workload(url, args.model, args))})
            print(runs[-1], flush=True)
    finally:
        gateway.close()
        await round_robin.stop()
        await service.close()
    env = environment()
    return {"environment": env, "device": device_name(env), "start_s": round(started, 1),
            "workload": {k: getattr(args, k) for k in ("conversations", "turns", "tasks", "max_tokens",
                                                        "prefix_repeats")},
            "runs": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser, engines=("sglang", "reference"))
    parser.add_argument("--conversations", type=int, default=128, help="rollouts running at once")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout")
    parser.add_argument("--tasks", type=int, default=16, help="distinct system prompts (groups of rollouts)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per turn")
    parser.add_argument("--prefix-repeats", type=int, default=40, help="system prompt length, in sentences")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    base = results["runs"][0]["tokens_per_s"]
    rows = [
        [r["setup"], r["tokens_per_s"], round(r["tokens_per_s"] / base, 2), r["cache_hit_rate"], r["seconds"]]
        for r in results["runs"]
    ]
    table = markdown_table(["setup", "rollout tokens/s", "vs 1 replica", "prefix-cache hit rate", "s"], rows)
    write_results(args, results, f"{results['device']}, {args.model}\n\n{table}")


if __name__ == "__main__":
    main()
