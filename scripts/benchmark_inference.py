"""Throughput and latency of concurrent chats on an inference engine, and its prefix-cache hit rate.

Starts the engine (`--engine sglang`, or the CPU `reference` engine), loads a random LoRA adapter of the
model's shape and sends chats through it, as rollouts do: every chat shares a long system prompt (the
agent's instructions) and asks its own question, with `ignore_eos` and a fixed `max_tokens` so every
request generates the same number of tokens. Per concurrency level: output tokens/s, time to first token
and request latency (median, p99), and the share of prompt tokens served from the prefix cache.

    python scripts/benchmark_inference.py --engine sglang --model /root/models/qwen2.5-1.5b-shape \
        --attention-backend triton --sampling-backend pytorch --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    environment,
    make_random_adapter,
    markdown_table,
    server_config,
    write_results,
)

from art_sglang.server.process import ServerProcess

ADAPTER = "bench@1"
# About 40 tokens a sentence with the project's tokenizer; repeated to the requested prefix length.
INSTRUCTIONS = (
    "You are an agent that plays a game of tic-tac-toe on a three by three board and answers with one move "
    "in the form row,column after thinking about the position and the opponent's threats. "
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_chat(client: AsyncOpenAI, system: str, i: int, max_tokens: int, model: str) -> dict[str, Any]:
    start = time.perf_counter()
    first: float | None = None
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"Game {i}: your move?"},
        ],
        max_tokens=max_tokens,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft_s": first if first is not None else latency,
        "latency_s": latency,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
    }


async def level(client: AsyncOpenAI, concurrency: int, requests: int, args: argparse.Namespace,
                system: str, model: str) -> dict[str, Any]:  # fmt: skip
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> dict[str, Any]:
        async with gate:
            return await one_chat(client, system, i, args.max_tokens, model)

    start = time.perf_counter()
    chats = await asyncio.gather(*(limited(i) for i in range(requests)))
    wall = time.perf_counter() - start
    prompt = sum(c["prompt_tokens"] for c in chats)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "wall_s": wall,
        "output_tokens_per_s": sum(c["completion_tokens"] for c in chats) / wall,
        "requests_per_s": requests / wall,
        "ttft_median_s": statistics.median(c["ttft_s"] for c in chats),
        "ttft_p99_s": percentile([c["ttft_s"] for c in chats], 0.99),
        "latency_median_s": statistics.median(c["latency_s"] for c in chats),
        "latency_p99_s": percentile([c["latency_s"] for c in chats], 0.99),
        "mean_prompt_tokens": prompt / requests,
        "prefix_cache_hit_rate": sum(c["cached_tokens"] for c in chats) / prompt if prompt else 0.0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir
    adapter = make_random_adapter(args.model, work / "adapter", rank=args.lora_rank)
    config = server_config(args)
    server = ServerProcess(config, args.model, engine=args.engine, log_path=work / "server.log")
    system = INSTRUCTIONS * max(1, args.prefix_tokens // 40)
    result: dict[str, Any] = {"environment": environment(), "engine": args.engine, "model": args.model,
                              "max_tokens": args.max_tokens, "config": config.model_dump(), "levels": []}  # fmt: skip
    try:
        start = time.perf_counter()
        await server.start()
        result["start_s"] = time.perf_counter() - start
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            response = await http.post(f"{server.base_url}/load_lora_adapter",
                                       json={"lora_name": ADAPTER, "lora_path": str(adapter)})  # fmt: skip
            response.raise_for_status()
        model = ADAPTER if args.adapter else args.model
        result["served_model"] = model
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)
        await level(client, 2, 4, args, system, model)  # warm-up: compiles, fills the prefix cache
        for concurrency in args.concurrency:
            requests = max(args.min_requests, 2 * concurrency)
            result["levels"].append(await level(client, concurrency, requests, args, system, model))
            print(result["levels"][-1], flush=True)
        await client.close()
    finally:
        await server.stop()
    return result


def table(result: dict[str, Any]) -> str:
    headers = ["concurrency", "requests", "output tok/s", "req/s", "TTFT median ms", "TTFT p99 ms",
               "latency median s", "latency p99 s", "prefix cache hit"]  # fmt: skip
    rows = [[lv["concurrency"], lv["requests"], lv["output_tokens_per_s"], lv["requests_per_s"],
             1000 * lv["ttft_median_s"], 1000 * lv["ttft_p99_s"], lv["latency_median_s"],
             lv["latency_p99_s"], f"{100 * lv['prefix_cache_hit_rate']:.1f}%"]
            for lv in result["levels"]]  # fmt: skip
    env = result["environment"]
    cuda_graph = "off" if result["config"]["disable_cuda_graph"] else "on"
    head = (
        f"{result['engine']} on {', '.join(env['gpus']) or 'CPU'}, {env['date']}; model {result['model']} "
        f"via adapter {result['served_model']}; {result['max_tokens']} output tokens per chat; "
        f"CUDA graphs {cuda_graph}; start {result['start_s']:.1f} s"
    )
    return head + "\n\n" + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=512, help="length of the shared system prompt")
    parser.add_argument(
        "--adapter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send chats to the LoRA adapter (as rollouts do) rather than the base model",
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_results(args, result, table(result))


if __name__ == "__main__":
    main()
