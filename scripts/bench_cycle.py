"""Shared mode's cost per training step, server side: free the GPU and bring inference back, by `restart`
(stop the server, start it again, reload the adapter) or by `sleep` (SGLang's release/resume memory
occupation with the memory saver and CPU weight backup; no restart). Each cycle ends when the adapter
answers again; its greedy output is checked against the one before the cycle, and the GPU memory freed is
read from nvidia-smi (a 200 from /release_memory_occupation alone proves nothing).

    python scripts/bench_cycle.py --model /root/models/qwen2.5-1.5b-shape \
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    environment,
    gpu_memory_used_mib,
    make_random_adapter,
    markdown_table,
    server_config,
    write_results,
)

from art_sglang.server.process import ServerProcess

ADAPTER = "bench@1"
PROMPT = [{"role": "user", "content": "Write a line of Python that prints a greeting."}]


async def _post(http: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> float:
    start = time.perf_counter()
    response = await http.post(url, json=payload)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url} -> {response.status_code}: {response.text[:500]}")
    return time.perf_counter() - start


async def _greedy(http: httpx.AsyncClient, base: str) -> tuple[str, float]:
    start = time.perf_counter()
    response = await http.post(
        f"{base}/v1/chat/completions",
        json={"model": ADAPTER, "messages": PROMPT, "max_tokens": 32, "temperature": 0.0},
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"], time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir
    adapter = make_random_adapter(args.model, work / "adapter", rank=args.lora_rank)
    config = server_config(args, enable_memory_saver=True, enable_weights_cpu_backup=True)
    server = ServerProcess(config, args.model, engine=args.engine, log_path=work / "server.log")
    load = {"lora_name": ADAPTER, "lora_path": str(adapter)}
    result: dict[str, Any] = {
        "environment": environment(),
        "model": args.model,
        "config": config.model_dump(),
    }
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        try:
            start = time.perf_counter()
            await server.start()
            result["cold_start_s"] = time.perf_counter() - start
            base = server.base_url
            result["first_adapter_load_s"] = await _post(http, f"{base}/load_lora_adapter", load)
            reference, _ = await _greedy(http, base)
            await _greedy(http, base)  # warm
            serving_mib = gpu_memory_used_mib()

            sleep_cycles = []
            for _ in range(args.cycles):
                start = time.perf_counter()
                release_s = await _post(http, f"{base}/release_memory_occupation", {})
                released_mib = gpu_memory_used_mib()
                resume_s = await _post(http, f"{base}/resume_memory_occupation", {})
                text, first_request_s = await _greedy(http, base)
                sleep_cycles.append({
                    "release_s": release_s, "resume_s": resume_s, "first_request_s": first_request_s,
                    "total_s": time.perf_counter() - start, "gpu_mib_serving": serving_mib,
                    "gpu_mib_released": released_mib, "output_identical": text == reference,
                })  # fmt: skip

            restart_cycles = []
            for _ in range(args.restart_cycles):
                start = time.perf_counter()
                await server.stop()
                stop_s = time.perf_counter() - start
                stopped_mib = gpu_memory_used_mib()
                await server.start()
                start_s = time.perf_counter() - start - stop_s
                base = server.base_url
                load_s = await _post(http, f"{base}/load_lora_adapter", load)
                text, first_request_s = await _greedy(http, base)
                restart_cycles.append({
                    "stop_s": stop_s, "start_s": start_s, "adapter_load_s": load_s,
                    "first_request_s": first_request_s, "total_s": time.perf_counter() - start,
                    "gpu_mib_serving": serving_mib, "gpu_mib_released": stopped_mib,
                    "output_identical": text == reference,
                })  # fmt: skip
        finally:
            await server.stop()
    result["sleep"] = sleep_cycles
    result["restart"] = restart_cycles
    return result


def table(result: dict[str, Any]) -> str:
    rows = []
    for strategy in ("sleep", "restart"):
        cycles = result[strategy]
        if not cycles:
            continue
        totals = [c["total_s"] for c in cycles]
        rows.append([
            strategy, len(cycles), statistics.median(totals), max(totals),
            cycles[-1]["gpu_mib_serving"], max((c["gpu_mib_released"] for c in cycles if c["gpu_mib_released"] is not None), default=None),
            all(c["output_identical"] for c in cycles),
        ])  # fmt: skip
    headers = ["strategy", "cycles", "median cycle s", "max cycle s", "GPU MiB serving",
               "GPU MiB freed state", "same greedy output"]  # fmt: skip
    env = result["environment"]
    head = (
        f"cold start {result['cold_start_s']:.1f} s; {', '.join(env['gpus']) or 'no GPU'}; "
        f"{env['date']}; CUDA graphs {'off' if result['config']['disable_cuda_graph'] else 'on'}"
    )
    return head + "\n\n" + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.add_argument("--cycles", type=int, default=5, help="sleep/wake cycles")
    parser.add_argument("--restart-cycles", type=int, default=1, help="stop/start cycles")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_results(args, result, table(result))


if __name__ == "__main__":
    main()
