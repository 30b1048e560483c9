"""Pipelined vs synchronous training, measured through the backend in one run: the same workload (the
character-share task: G groups x N rollouts of <= T tokens with logprobs, LoRA r=16) and seed, first as
`gather -> train -> gather` (`environments.common.train_loop`), then with ART's PipelineTrainer
(`environments.pipelined.pipelined_loop`, at most K steps off policy), each on its own model of one
backend (one server start for both). Per loop: steps per minute, over the whole loop (from its start to
the end of its last `train()`) and in steady state (from the end of its first step on: a loop's first step
carries one-off costs, the trainer compiling its kernels, that a run of hundreds of steps pays once and
that would hide the rate in a few-step run), trajectories trained per minute in steady state (the
headline ratio; it is given only when both loops trained the same trajectories), the mean reward of every
step's batch, the seconds each step took, how long each waited for its batch (the synchronous loop: its
rollouts; the pipelined loop: what training did not cover), each step's trainer metrics (`train_metrics`:
the phases of the step, on the slowest and the fastest rank, its rows, micro-batches and padded tokens,
the weight sync and the probe: what tells a slow step's cause), and for the pipelined loop how far its
batches were off policy: `steps_behind_max`/`steps_behind_mean`, the policy each batch trains from less the
policy that sampled its groups, what `max_steps_off_policy` bounds, and PipelineTrainer's own
`train/steps_off_policy` (`art_steps_off_policy`: counted from the step the batch produces, so an
on-policy batch is 1 and the bound's largest is K + 1), with the groups it discarded as stale.

`--weights merged` serves merged weights the trainer pushes (`weight_sync_method="merged"`) instead of
adapters (issue 40: pipelined merged against pipelined LoRA). Layouts: `co_resident` (server and trainer on
GPU 0, no handoff), `split` (server on GPU 0, trainer on
GPU 1), `replicas` (two servers on GPUs 0-1 behind SGLang's router, a two-rank trainer on GPUs 2-3),
`four_gpu` (the description's example: the server on GPU 0, a three-rank trainer on GPUs 1-3), `cpu` (the
reference engine, for a smoke run).

    python scripts/bench_pipeline.py --model /root/models/qwen2.5-1.5b-shape --layout co_resident \\
        --sampling-backend pytorch --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ from a source checkout
from bench_common import (
    device_name,
    environment,
    markdown_table,
    rollout_workload,
    server_config,
    training_bench_parser,
    version_in,
    workload_phrase,
    write_results,
)

import art_sglang
from art_sglang import SGLangBackend, TrainerConfig
from environments.char_share import CharShareTask
from environments.common import train_loop
from environments.environment import StepReport
from environments.pipelined import openpipe_art, pipelined_loop

LAYOUTS = ("co_resident", "split", "replicas", "four_gpu", "cpu")


def make_backend(args: argparse.Namespace, path: Path) -> SGLangBackend:
    k = args.max_steps_off_policy
    config = server_config(
        args, max_steps_off_policy=k, max_loras_per_batch=max(4, k + 1), weight_sync_method=args.weights
    )
    common: dict[str, Any] = {
        "path": str(path),
        "sglang_config": config,
        "trainer_config": TrainerConfig(
            lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, seed=args.seed
        ),
    }
    if args.layout == "cpu":
        return SGLangBackend(engine="reference", **common)
    if args.layout == "split":
        return SGLangBackend(engine="sglang", inference_device=0, training_devices=[1], **common)
    if args.layout == "replicas":
        return SGLangBackend(engine="sglang", inference_devices=[0, 1], training_devices=[2, 3], **common)
    if args.layout == "four_gpu":  # the product description's example
        return SGLangBackend(engine="sglang", inference_device=0, training_devices=[1, 2, 3], **common)
    return SGLangBackend(
        engine="sglang", inference_device=0, training_devices=[0], shared_strategy="co_resident",
        cuda_mps=args.cuda_mps, **common,
    )  # fmt: skip


async def run_loop(backend: SGLangBackend, model: Any, loop: str, args: argparse.Namespace) -> dict[str, Any]:
    """One loop's steps on `model` (registered): its per-step reports and timings."""
    task = CharShareTask(max_tokens=args.max_tokens)
    ends: list[float] = []

    def on_step(report: StepReport) -> None:
        ends.append(time.perf_counter())
        print(f"{loop} step {len(ends)}/{args.steps}: mean reward {report.mean_reward:.4f}", flush=True)

    options: dict[str, Any] = {
        "steps": args.steps, "groups_per_step": args.groups, "group_size": args.group_size,
        "learning_rate": args.learning_rate, "seed": args.seed, "on_step": on_step,
    }  # fmt: skip
    started = time.perf_counter()
    if loop == "sync":
        reports = await train_loop(backend, model, task, **options)
    else:
        reports = await pipelined_loop(
            backend, model, task, max_steps_off_policy=args.max_steps_off_policy, **options
        )
    result = {
        **loop_rates(started, ends, [len(r.rewards) for r in reports]),
        "mean_reward": [r.mean_reward for r in reports],
        "train_s": [r.train_metrics.get("time/train_s") for r in reports],
        "batch_wait_s": [r.rollout_s for r in reports],
        "train_metrics": [r.train_metrics for r in reports],
    }
    if loop == "pipelined":
        result["steps_behind_max"] = [max(r.steps_behind) for r in reports]
        result["steps_behind_mean"] = [statistics.fmean(r.steps_behind) for r in reports]
    return result


def loop_rates(started: float, ends: list[float], trajectories: list[int]) -> dict[str, Any]:
    """A loop's rates from its start, the end of each step and the trajectories each step trained.
    Steady: from the end of the first step on. Trajectories per minute is the fair one: a loop whose
    last step trained only the groups left (PipelineTrainer's, before its scenario stream was endless: 16
    of 64 in one run) has steps per minute that look better than the work done. `median_step_s`: the
    median step after the first, which one slow step (a recompile) does not move."""
    wall = ends[-1] - started
    steady = ends[-1] - ends[0]
    step_s = [b - a for a, b in itertools.pairwise([started, *ends])]
    return {
        "steps": len(ends),
        "wall_s": wall,
        "steps_per_minute": 60.0 * len(ends) / wall,
        "steady_steps_per_minute": 60.0 * (len(ends) - 1) / steady if len(ends) > 1 else None,
        "steady_trajectories_per_minute": 60.0 * sum(trajectories[1:]) / steady if len(ends) > 1 else None,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[1:]) if len(ends) > 1 else None,
        "trajectories": trajectories,
    }


def pipeline_history(history: Path) -> dict[str, Any]:
    """PipelineTrainer's own record of a run, from its history.jsonl: each step's `steps_off_policy` and
    the groups it discarded as stale (a cumulative count)."""
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    trained = [row for row in rows if "train/steps_off_policy" in row]
    return {
        "art_steps_off_policy": [row["train/steps_off_policy"] for row in trained],
        "discarded_stale_groups": int(trained[-1].get("train/discarded_stale_groups", 0)) if trained else 0,
    }


async def run_on_backend(args: argparse.Namespace, path: Path, models: dict[str, Any]) -> dict[str, Any]:
    """`models`' loops, one after another, on one backend at `path` (one server start): their results,
    the registration's seconds and what the backend settled."""
    shutil.rmtree(path, ignore_errors=True)  # every loop starts from step 0
    backend = make_backend(args, path)
    loops: dict[str, Any] = {}
    async with backend:
        registered = time.perf_counter()
        for model in models.values():
            await model.register(backend)
        register_s = time.perf_counter() - registered
        for loop, model in models.items():
            loops[loop] = await run_loop(backend, model, loop, args)
        if "pipelined" in loops:
            history = path / "bench-pipeline" / "models" / "bench-pipelined" / "history.jsonl"
            loops["pipelined"].update(pipeline_history(history))
        return {
            "loops": loops,
            "register_s": register_s,
            "layout": backend.layout.describe(),
            "config": backend.sglang_config.model_dump(),
            "cuda_mps": backend.uses_cuda_mps,
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    # PipelineTrainer keeps its state with ART's own model class; the synchronous loop takes either.
    models = {
        loop: module.TrainableModel(name=f"bench-{loop}", project="bench-pipeline", base_model=args.model)
        for loop, module in (("sync", art_sglang), ("pipelined", openpipe_art()))
    }
    root = args.workdir / f"pipeline-{args.layout}-{args.weights}"
    if args.weights == "lora":  # both models on one backend
        runs = [await run_on_backend(args, root / ".art", models)]
    else:  # merged weights are one model's: a backend (and server start) per loop
        runs = [await run_on_backend(args, root / loop / ".art", {loop: m}) for loop, m in models.items()]
    loops = {loop: result for one in runs for loop, result in one["loops"].items()}
    register_s = sum(one["register_s"] for one in runs)
    layout, config, cuda_mps = runs[0]["layout"], runs[0]["config"], runs[0]["cuda_mps"]
    step_ratio = ratio(loops, "median_step_s")
    result: dict[str, Any] = {
        "device": device_name(env),
        "date": env["date"],
        "versions": env["versions"],
        "engine": "reference" if args.layout == "cpu" else "sglang",
        "model": args.model,
        "layout": args.layout,
        "weights": args.weights,
        "layout_detail": layout,
        "cuda_mps": cuda_mps,
        "workload": {
            **rollout_workload(args),
            "steps": args.steps,
            "seed": args.seed,
            "max_steps_off_policy": args.max_steps_off_policy,
        },
        "register_s": register_s,
        "loops": loops,
        "speedup": ratio(loops, "steady_trajectories_per_minute"),
        "speedup_steady_steps": ratio(loops, "steady_steps_per_minute"),
        "speedup_whole_loop": ratio(loops, "steps_per_minute"),
        # Sync's median step over pipelined's: the steady rate's ratio without each loop's slowest steps.
        "speedup_median_step": 1 / step_ratio if step_ratio else None,
        "sglang_config": config,
    }
    if result["engine"] == "sglang":
        result["versions"]["sglang"] = version_in(server_config(args).resolved_server_python(), "sglang")
    return result


def ratio(loops: dict[str, Any], key: str) -> float | None:
    """Pipelined over synchronous `key`; None where a loop has no such rate (a one-step run) or the loops
    trained different work (a loop that stopped early is no comparison)."""
    pipelined, sync = loops["pipelined"], loops["sync"]
    if pipelined["trajectories"] != sync["trajectories"] or not pipelined[key] or not sync[key]:
        return None
    return pipelined[key] / sync[key]


def table(result: dict[str, Any]) -> str:
    headers = ["loop", "steps", "wall s", "steps/min", "steps/min after step 1",
               "trajectories/min after step 1", "s/step (median)", "batch wait s (median)",
               "mean reward per step", "steps behind (mean, max)", "stale groups discarded"]  # fmt: skip
    rows = []
    for name, loop in result["loops"].items():
        behind = loop.get("steps_behind_mean")
        rows.append([
            name, loop["steps"], loop["wall_s"], loop["steps_per_minute"],
            loop["steady_steps_per_minute"] or "-", loop["steady_trajectories_per_minute"] or "-",
            statistics.median(loop["step_s"]), statistics.median(loop["batch_wait_s"]),
            " ".join(f"{r:.3f}" for r in loop["mean_reward"]),
            f"{statistics.fmean(behind):.2f}, {max(loop['steps_behind_max'])}" if behind else "-",
            loop.get("discarded_stale_groups", "-"),
        ])  # fmt: skip
    w = result["workload"]
    head = (
        f"{result['engine']} on {result['device']} ({result['layout']}"
        f"{', CUDA MPS' if result.get('cuda_mps') else ''}, {result.get('weights', 'lora')} weights), "
        f"{result['date']}; model "
        f"{result['model']}; {workload_phrase(w)}, max_steps_off_policy={w['max_steps_off_policy']}, "
        f"seed {w['seed']}; "
        f"pipelined / synchronous trajectories trained per minute after the first step: "
        f"{times(result['speedup'])} (steps per minute: {times(result['speedup_steady_steps'])} after the "
        f"first step, {times(result['speedup_whole_loop'])} over the whole loop; by the median step after the "
        f"first: {times(result['speedup_median_step'])})"
    )
    return head + "\n\n" + markdown_table(headers, rows)


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = training_bench_parser(__doc__)
    parser.add_argument("--layout", choices=LAYOUTS, default="co_resident")
    parser.add_argument("--steps", type=int, default=6, help="training steps per loop")
    parser.add_argument("--max-steps-off-policy", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weights", choices=("lora", "merged"), default="lora",
        help="SGLangConfig.weight_sync_method: adapters served with LoRA kernels, or merged weights pushed",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-mps", choices=("auto", "on", "off"), default="auto",
        help="co_resident layout: server and trainer as clients of a CUDA MPS daemon (SGLangBackend's cuda_mps)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.layout == "cpu":
        args.engine = "reference"
    result = asyncio.run(run(args))
    write_results(args, result, table(result))


if __name__ == "__main__":
    main()
