"""Rollout serving on one inference engine: throughput, latency and prefix-cache hits on the request
patterns of RL, and the adapter hot-load path.

Starts the engine (`sglang`, `vllm`, or the CPU `reference` engine) with LoRA, loads a random adapter of
the model's shape and sends streamed chats through it with `ignore_eos` and a fixed `max_tokens` (every
request generates the same number of tokens). Workloads:

- `grpo`: G groups x n rollouts; the rollouts of a group send the same long prompt, groups share nothing;
- `multiturn`: C conversations of T turns; each turn resends the conversation so far (a growing prefix);
- `unique`: the control: as many requests as grpo, each with its own prompt of the same length.

Each (workload, concurrency) run tags its prompts afresh, so no run finds another's prefixes cached. Per
run: output tokens/s, time to first token and latency (median, p99), and the share of prompt tokens the
engine reports as cached (`usage.prompt_tokens_details.cached_tokens`; vLLM's `/metrics` prefix-cache
counters too). `--prefix-cache on off` starts the engine twice, with SGLang's radix cache (vLLM's prefix
caching) on and off. Hot-load: K fresh adapters, each timed from the load request to its first answer.

    python scripts/benchmark_inference.py --engine sglang --model /root/models/qwen2.5-1.5b-shape \\
        --sampling-backend pytorch --prefix-cache on off --json out.json
    python scripts/benchmark_inference.py --engine vllm --model /root/models/qwen2.5-1.5b-shape \\
        --attention-backend FLASH_ATTN --json out.json          # vLLM's python: $ART_SGLANG_VLLM_PYTHON
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    device_name,
    environment,
    make_random_adapter,
    markdown_table,
    server_settings,
    version_in,
    write_results,
)
from inference_engines import EngineServer

ADAPTER = "bench@1"
WORKLOADS = ("grpo", "multiturn", "unique")
# Repeated to the requested prompt length.
INSTRUCTIONS = (
    "You are an agent that plays a game of tic-tac-toe on a three by three board and answers with one move "
    "in the form row,column after thinking about the position and the opponent's threats. "
)


@dataclass(frozen=True)
class Conversation:
    """A system prompt and the user turns sent one after another, each with every earlier turn and
    answer before it."""

    system: str
    turns: tuple[str, ...]


# One chat turn: the messages so far -> the result, with the answer's "text".
Chat = Callable[[list[dict[str, str]]], Awaitable[dict[str, Any]]]


def prompt_body(model: str, tokens: int) -> str:
    """INSTRUCTIONS repeated to at least `tokens` tokens of the model's tokenizer."""
    from transformers import AutoTokenizer

    per_copy = len(AutoTokenizer.from_pretrained(model)(INSTRUCTIONS, add_special_tokens=False)["input_ids"])
    return INSTRUCTIONS * max(1, math.ceil(tokens / per_copy))


def conversations(workload: str, args: argparse.Namespace, tag: str, body: str) -> list[Conversation]:
    """The conversations of one run of `workload`; `tag` (unique per run) starts every prompt, `body`
    makes it long."""
    if workload == "grpo":
        return [
            Conversation(f"{tag} group {g}. {body}", (f"Game {g}: your move?",))
            for g in range(args.groups)
            for _ in range(args.group_size)
        ]
    if workload == "unique":
        # The request's own number comes first: no two prompts share more than the chat template's head.
        return [
            Conversation(f"Request {i} {tag}. {body}", (f"Game {i}: your move?",))
            for i in range(args.groups * args.group_size)
        ]
    if workload == "multiturn":
        return [
            Conversation(f"{tag} conversation {c}. {body}",
                         tuple(f"Turn {t}: your move?" for t in range(args.turns)))
            for c in range(args.conversations)
        ]  # fmt: skip
    raise ValueError(f"unknown workload {workload!r}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_chat(
    client: AsyncOpenAI, messages: list[dict[str, str]], model: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed chat: TTFT, latency, token counts and cached prompt tokens from the final usage."""
    start = time.perf_counter()
    first: float | None = None
    usage = None
    text: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "text": "".join(text),
        "ttft_s": first if first is not None else latency,
        "latency_s": latency,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
    }


def summarize(chats: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Throughput, latency percentiles (and TTFT's, for streamed chats) and the cached share of prompt
    tokens of one run's chats."""
    prompt = sum(c["prompt_tokens"] for c in chats)
    output = [c["completion_tokens"] for c in chats]
    latency = [c["latency_s"] for c in chats]
    summary = {
        "requests": len(chats),
        "wall_s": wall,
        "output_tokens_per_s": sum(output) / wall,
        "requests_per_s": len(chats) / wall,
        "latency_median_s": statistics.median(latency),
        "latency_p99_s": percentile(latency, 0.99),
        "mean_prompt_tokens": prompt / len(chats),
        "mean_completion_tokens": sum(output) / len(chats),
        "cached_share": sum(c["cached_tokens"] for c in chats) / prompt if prompt else 0.0,
    }
    if all("ttft_s" in c for c in chats):
        ttft = [c["ttft_s"] for c in chats]
        summary.update(ttft_median_s=statistics.median(ttft), ttft_p99_s=percentile(ttft, 0.99))
    return summary


async def converse(conversation: Conversation, chat: Chat) -> list[dict[str, Any]]:
    """The conversation's turns one after another, each sent (by `chat`, which answers a result with the
    answer's "text") with every earlier turn and answer; the turns' results without the text."""
    messages = [{"role": "system", "content": conversation.system}]
    chats = []
    for turn in conversation.turns:
        messages.append({"role": "user", "content": turn})
        result = await chat(messages)
        messages.append({"role": "assistant", "content": result.pop("text")})
        chats.append(result)
    return chats


async def run_workload(
    client: AsyncOpenAI,
    server: EngineServer,
    http: httpx.AsyncClient,
    workload: str,
    concurrency: int,
    args: argparse.Namespace,
    tag: str,
    body: str,
) -> dict[str, Any]:
    """Every conversation of `workload` at once, at most `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    model = server.adapter_model(ADAPTER)

    async def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
        async with gate:
            return await one_chat(client, messages, model, args.max_tokens)

    before = await server.prefix_cache_counters(http)
    start = time.perf_counter()
    done = await asyncio.gather(*(converse(c, chat) for c in conversations(workload, args, tag, body)))
    result = {
        "workload": workload,
        "concurrency": concurrency,
        **summarize(list(itertools.chain.from_iterable(done)), time.perf_counter() - start),
    }
    after = await server.prefix_cache_counters(http)
    if before is not None and after is not None:
        queries = after["queries"] - before["queries"]
        result["engine_prefix_cache_hit_rate"] = (
            (after["hits"] - before["hits"]) / queries if queries else 0.0
        )
    return result


async def hot_loads(
    server: EngineServer, http: httpx.AsyncClient, client: AsyncOpenAI, adapters: list[Path], run: int
) -> list[dict[str, float]]:
    """Per adapter: load it, then one short chat on it (the first answer), then unload it."""
    timings = []
    for index, path in enumerate(adapters):
        name = f"hot{index}@{run}"
        start = time.perf_counter()
        await server.load_adapter(http, name, path)
        loaded = time.perf_counter()
        await client.chat.completions.create(
            model=server.adapter_model(name),
            messages=[{"role": "user", "content": "Your move?"}],
            max_tokens=8,
            temperature=0.0,
        )
        answered = time.perf_counter()
        await server.unload_adapter(http, name)
        timings.append(
            {"load_s": loaded - start, "first_answer_s": answered - loaded, "total_s": answered - start}
        )
    return timings


async def run_engine(
    args: argparse.Namespace, prefix_cache: bool, run: int, adapters: list[Path], body: str
) -> dict[str, Any]:
    """One server start: every workload at every concurrency, then the hot-loads."""
    settings = server_settings(args, prefix_cache=prefix_cache)
    server = EngineServer(args.engine, settings, log_path=args.workdir / f"{args.engine}-{run}.log")
    record: dict[str, Any] = {"prefix_cache": prefix_cache, "results": []}
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        try:
            start = time.perf_counter()
            await server.start()
            record["start_s"] = time.perf_counter() - start
            record["command"] = server.command()
            await server.load_adapter(http, ADAPTER, adapters[0])
            client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)
            # Warm-up (kernels compiled, adapter in the GPU pool); its own tag, so it caches nothing used later.
            await run_workload(client, server, http, "grpo", 2, _warmup(args), f"[warm-up {run}]", body)
            for concurrency, workload in itertools.product(args.concurrency, args.workloads):
                tag = f"[run {run}.{concurrency}.{workload}]"
                record["results"].append(
                    await run_workload(client, server, http, workload, concurrency, args, tag, body)
                )
                print(record["results"][-1], flush=True)
            record["hot_load"] = await hot_loads(server, http, client, adapters[1:], run)
            await client.close()
        finally:
            await server.stop()
    return record


def _warmup(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "groups": 1, "group_size": 4})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every `--prefix-cache` setting in turn on `args.engine`: the result document."""
    env = environment()
    adapters = [
        make_random_adapter(args.model, args.workdir / f"adapter-{seed}", rank=args.lora_rank, seed=seed)
        for seed in range(1 + args.hot_loads)
    ]
    versions = dict(env["versions"])
    if args.engine != "reference":  # the server's own stack
        python = EngineServer(args.engine, server_settings(args), log_path=args.workdir / "-").interpreter()
        versions[args.engine] = version_in(python, args.engine)
    result: dict[str, Any] = {
        "device": device_name(env),
        "date": env["date"],
        "versions": versions,
        "engine": args.engine,
        "model": args.model,
        "lora_rank": args.lora_rank,
        "max_tokens": args.max_tokens,
        "prefix_tokens": args.prefix_tokens,
        "workloads": {
            "grpo": {"groups": args.groups, "group_size": args.group_size},
            "multiturn": {"conversations": args.conversations, "turns": args.turns},
            "unique": {"requests": args.groups * args.group_size},
        },
        "runs": [],
    }
    body = prompt_body(args.model, args.prefix_tokens)
    for run_index, setting in enumerate(args.prefix_cache):
        result["runs"].append(await run_engine(args, setting == "on", run_index, adapters, body))
    return result


def table(result: dict[str, Any]) -> str:
    headers = ["prefix cache", "workload", "concurrency", "requests", "output tok/s", "TTFT median ms",
               "TTFT p99 ms", "latency median s", "latency p99 s", "prompt tokens", "cached"]  # fmt: skip
    rows = []
    for run in result["runs"]:
        for r in run["results"]:
            rows.append(["on" if run["prefix_cache"] else "off", r["workload"], r["concurrency"], r["requests"],
                         r["output_tokens_per_s"], 1000 * r["ttft_median_s"], 1000 * r["ttft_p99_s"],
                         r["latency_median_s"], r["latency_p99_s"], round(r["mean_prompt_tokens"]),
                         f"{100 * r['cached_share']:.1f}%"])  # fmt: skip
    loads = [t for run in result["runs"] for t in run.get("hot_load", [])]
    hot = (
        f"; adapter hot-load (load -> first answer, median of {len(loads)}): "
        f"{1000 * statistics.median(t['load_s'] for t in loads):.1f} ms load + "
        f"{1000 * statistics.median(t['first_answer_s'] for t in loads):.1f} ms answer"
        if loads
        else ""
    )
    starts = ", ".join(f"{run['start_s']:.1f} s" for run in result["runs"])
    head = (
        f"{result['engine']} on {result['device']}, {result['date']}; model {result['model']} via a random "
        f"LoRA r={result['lora_rank']}; prompts ~{result['prefix_tokens']} tokens, {result['max_tokens']} "
        f"output tokens per request; start {starts}{hot}"
    )
    return head + "\n\n" + markdown_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser, engines=("sglang", "reference", "vllm"))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="length of the long prompts")
    parser.add_argument("--groups", type=int, default=16, help="grpo: groups (unique: groups x group size)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=32, help="multiturn: conversations")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    parser.add_argument(
        "--prefix-cache",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="one engine start per setting (SGLang radix cache, vLLM prefix caching)",
    )
    parser.add_argument("--hot-loads", type=int, default=5, help="adapters hot-loaded per engine start")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    result = asyncio.run(run(args))
    write_results(args, result, table(result))


if __name__ == "__main__":
    main()
