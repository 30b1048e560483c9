"""What the adapter gateway adds to a request: latency and throughput straight to the server vs through
the gateway, for a request that does no generation (GET /v1/models: the proxy's own cost), a one-token
chat on a loaded adapter, and a streamed 16-token chat. Direct and gateway runs alternate, so drift in the
machine's load affects both alike.

    python scripts/bench_gateway.py --engine reference --model /tmp/tiny --json gw.json --markdown gw.md
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    environment,
    make_random_adapter,
    markdown_table,
    server_config,
    write_results,
)

from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.client import ServerClient
from art_sglang.serving.servers.process import ServerProcess

ADAPTER = "bench@1"


def workloads() -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    chat = {"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
    return {
        "GET /v1/models": ("GET", "/v1/models", None),
        "chat, 1 token": ("POST", "/v1/chat/completions", {**chat, "max_tokens": 1}),
        "chat, 16 tokens, streamed": (
            "POST",
            "/v1/chat/completions",
            {**chat, "max_tokens": 16, "stream": True, "ignore_eos": True},
        ),
    }


async def timed_requests(
    url: str, method: str, path: str, body: dict | None, count: int, concurrency: int
) -> tuple[list[float], float]:
    """Latencies (s) of `count` requests, `concurrency` at a time on keep-alive connections, and the wall
    time of the whole run."""
    latencies: list[float] = []
    queue = iter(range(count))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as http:

        async def worker() -> None:
            for _ in queue:
                started = time.perf_counter()
                response = await http.request(method, path, json=body)
                await response.aread()
                response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


def _ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


async def run(args: argparse.Namespace) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    adapter = make_random_adapter(args.model, args.workdir / "bench-adapter", rank=args.lora_rank)
    server = ServerProcess(
        server_config(args), args.model, engine=args.engine, log_path=args.workdir / "server.log"
    )
    await server.start()
    gateway = AdapterGateway(server.base_url)
    try:
        async with ServerClient(server.base_url) as client:
            await client.load_lora_adapter(ADAPTER, str(adapter))
        gateway.start()
        gateway.set_served([ADAPTER], [args.model])
        targets = {"direct": server.base_url, "gateway": gateway.base_url}
        rows, results = [], []
        for name, (method, path, body) in workloads().items():
            for concurrency in args.concurrency:
                lat: dict[str, list[float]] = {"direct": [], "gateway": []}
                wall: dict[str, float] = {"direct": 0.0, "gateway": 0.0}
                for _ in range(args.rounds):  # alternate so both see the same machine load
                    for target, url in targets.items():
                        await timed_requests(url, method, path, body, concurrency, concurrency)  # warm-up
                        got, seconds = await timed_requests(
                            url, method, path, body, args.requests, concurrency
                        )
                        lat[target] += got
                        wall[target] += seconds
                entry = {
                    "workload": name,
                    "concurrency": concurrency,
                    "requests": len(lat["direct"]),
                    **{f"{t}_p50_ms": _ms(lat[t], 50) for t in targets},
                    **{f"{t}_p95_ms": _ms(lat[t], 95) for t in targets},
                    **{f"{t}_req_per_s": len(lat[t]) / wall[t] for t in targets},
                }
                entry["added_p50_ms"] = entry["gateway_p50_ms"] - entry["direct_p50_ms"]
                results.append(entry)
                rows.append(
                    [name, concurrency, entry["direct_p50_ms"], entry["gateway_p50_ms"], entry["added_p50_ms"],
                     entry["direct_p95_ms"], entry["gateway_p95_ms"], entry["direct_req_per_s"],
                     entry["gateway_req_per_s"]]
                )  # fmt: skip
        table = markdown_table(
            ["workload", "concurrency", "direct p50 ms", "gateway p50 ms", "added p50 ms", "direct p95 ms",
             "gateway p95 ms", "direct req/s", "gateway req/s"],
            rows,
        )  # fmt: skip
        write_results(
            args,
            {"engine": args.engine, "model": args.model, "environment": environment(), "results": results},
            table,
        )
    finally:
        gateway.close()
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    parser.add_argument("--requests", type=int, default=100, help="requests per target, round and level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
