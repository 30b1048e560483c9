"""SGLang and vLLM side by side: `benchmark_inference.py`'s workloads (GRPO groups sharing a long prompt,
multi-turn with a growing prefix, the no-shared-prefix control) and its adapter hot-load on each engine,
back to back on one machine, with the same model, random adapter shape and request settings. Writes one
JSON (both engines' full results and the ratios) and a table; ratios are SGLang / vLLM (throughput above
1, times below 1 favour SGLang). Compares the runs with the prefix cache on.

An engine whose results already exist (`--reuse ENGINE=PATH`, a `benchmark_inference.py --json` file of
the same workloads) is not run again; the others are, with `--ENGINE-flags`.

    python scripts/bench_engines.py --model /root/models/qwen2.5-1.5b-shape \\
        --sglang-flags "--sampling-backend pytorch" \\
        --vllm-flags "--attention-backend FLASH_ATTN" --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_inference
from bench_common import markdown_table, write_results

ENGINES = ("sglang", "vllm")
# What must be equal for two results to compare the same work.
SAME_WORK = ("model", "lora_rank", "max_tokens", "prefix_tokens", "workloads")


def engine_args(args: argparse.Namespace, engine: str) -> argparse.Namespace:
    """benchmark_inference's arguments for `engine`: the shared ones, then the engine's own flags."""
    argv = ["--engine", engine, "--model", args.model, "--workdir", str(args.workdir / engine)]
    argv += shlex.split(args.common_flags) + shlex.split(getattr(args, f"{engine}_flags"))
    return benchmark_inference.build_parser().parse_args(argv)


def reused(args: argparse.Namespace) -> dict[str, Path]:
    paths = {}
    for item in args.reuse:
        engine, sep, path = item.partition("=")
        if not sep or engine not in ENGINES:
            raise SystemExit(f"--reuse {item!r}: use ENGINE=PATH with ENGINE in {ENGINES}")
        paths[engine] = Path(path)
    return paths


async def results(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each engine's benchmark_inference result, read from --reuse when that file exists, else run."""
    paths = reused(args)
    out = {}
    for engine in ENGINES:
        path = paths.get(engine)
        if path is not None and path.exists():
            print(f"{engine}: results from {path}", flush=True)
            out[engine] = json.loads(path.read_text())
        else:
            out[engine] = await benchmark_inference.run(engine_args(args, engine))
    return out


def compare(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios SGLang / vLLM per (workload, concurrency) of the prefix-cache-on runs, and of the hot-load."""
    sglang, vllm = engines["sglang"], engines["vllm"]
    differ = [key for key in SAME_WORK if sglang[key] != vllm[key]]
    if differ:
        raise SystemExit(f"the two results did not run the same work: {differ} differ")
    runs = {name: _cached_run(result) for name, result in engines.items()}
    rows = []
    for mine in runs["sglang"]["results"]:
        theirs = next(
            (r for r in runs["vllm"]["results"]
             if (r["workload"], r["concurrency"]) == (mine["workload"], mine["concurrency"])),
            None,
        )  # fmt: skip
        if theirs is None:
            continue
        row: dict[str, Any] = {"workload": mine["workload"], "concurrency": mine["concurrency"]}
        for key in (
            "output_tokens_per_s",
            "ttft_median_s",
            "ttft_p99_s",
            "latency_median_s",
            "latency_p99_s",
        ):
            row[key] = {"sglang": mine[key], "vllm": theirs[key], "ratio": mine[key] / theirs[key]}
        row["cached_share"] = {"sglang": mine["cached_share"], "vllm": theirs["cached_share"]}
        rows.append(row)
    hot = {name: _hot_load_median(run) for name, run in runs.items()}
    return {
        "workloads": rows,
        "hot_load_total_s": {
            **hot,
            "ratio": hot["sglang"] / hot["vllm"] if hot["sglang"] and hot["vllm"] else None,
        },
        "start_s": {name: run["start_s"] for name, run in runs.items()},
    }


def _cached_run(result: dict[str, Any]) -> dict[str, Any]:
    for run in result["runs"]:
        if run["prefix_cache"]:
            return run
    raise SystemExit(f"{result['engine']}: no run with the prefix cache on to compare")


def _hot_load_median(run: dict[str, Any]) -> float | None:
    loads = run.get("hot_load") or []
    return statistics.median(t["total_s"] for t in loads) if loads else None


def table(document: dict[str, Any]) -> str:
    ratios = document["ratios"]
    headers = ["workload", "concurrency", "SGLang tok/s", "vLLM tok/s", "tok/s ratio", "SGLang TTFT ms",
               "vLLM TTFT ms", "TTFT ratio", "SGLang latency s", "vLLM latency s", "latency ratio",
               "cached SGLang", "cached vLLM"]  # fmt: skip
    rows = []
    for r in ratios["workloads"]:
        tps, ttft, lat, cached = (
            r["output_tokens_per_s"],
            r["ttft_median_s"],
            r["latency_median_s"],
            r["cached_share"],
        )
        rows.append([r["workload"], r["concurrency"], tps["sglang"], tps["vllm"], tps["ratio"],
                     1000 * ttft["sglang"], 1000 * ttft["vllm"], ttft["ratio"], lat["sglang"], lat["vllm"],
                     lat["ratio"], f"{100 * cached['sglang']:.1f}%", f"{100 * cached['vllm']:.1f}%"])  # fmt: skip
    sglang = document["engines"]["sglang"]
    versions = document["versions"]
    hot = ratios["hot_load_total_s"]
    hot_text = (
        f"adapter hot-load (load -> first answer, median): SGLang {1000 * hot['sglang']:.1f} ms, "
        f"vLLM {1000 * hot['vllm']:.1f} ms"
        if hot["sglang"] and hot["vllm"]
        else "adapter hot-load: not measured"
    )
    head = (
        f"SGLang {versions['sglang']} vs vLLM {versions['vllm']} on {sglang['device']}, {sglang['date']}; "
        f"model {sglang['model']} via a random LoRA r={sglang['lora_rank']}; medians; ratio = SGLang / vLLM; "
        f"{hot_text}; start {ratios['start_s']['sglang']:.1f} s / {ratios['start_s']['vllm']:.1f} s"
    )
    return head + "\n\n" + markdown_table(headers, rows)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = await results(args)
    return {
        "versions": {name: engines[name]["versions"].get(name) for name in ENGINES},
        "ratios": compare(engines),
        "engines": engines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--common-flags", default="", help="benchmark_inference.py flags for both engines")
    parser.add_argument("--sglang-flags", default="", help="benchmark_inference.py flags for SGLang only")
    parser.add_argument("--vllm-flags", default="", help="benchmark_inference.py flags for vLLM only")
    parser.add_argument("--reuse", action="append", default=[], metavar="ENGINE=PATH",
                        help="take ENGINE's results from PATH when that file exists (else run it)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/art-sglang-bench-engines"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    document = asyncio.run(run(args))
    write_results(args, document, table(document))


if __name__ == "__main__":
    main()
