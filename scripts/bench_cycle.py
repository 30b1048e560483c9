"""What shared mode costs per training step, measured through the backend: `SGLangBackend.train()` as a
user calls it, on GRPO rollouts sampled through `model.openai_client()` (the character-share task: 8
groups x 8 rollouts of ~96 tokens with logprobs, LoRA r=16), for each way of sharing the GPU:

- `sleep/kv_cache`: the server releases its KV cache and keeps its weights; the trainer stays on the GPU;
- `sleep/all`: the server releases its weights too (CPU backup) and the trainer offloads to CPU between
  steps;
- `restart`: the server is stopped for the step and started again.

Each strategy gets its own backend (register, N steps, close). Per step: `overhead_s` = `time/step_s` -
`time/train_s` of the step's TrainResult (what the step costs beyond the trainer's own work: releasing
and resuming the GPU, the weight sync, the probe), the trainer's `time/train_s`, `time/gpu_release_s`,
`time/gpu_resume_s`, `time/sync_s`; GPU memory during the step (the server's while the trainer held
the GPU, the trainer's peak, the lowest total, from nvidia-smi); and whether the handoff kept what the
server serves: the served logprobs of one fixed text on the previous step's adapter, before and after
the step, agree within `--logprob-tolerance` (mean absolute difference). Unlike comparing greedy outputs,
this does not trip over argmax ties of a random-weight model (near-equal logits flip between batch
shapes), and a lost or wrong adapter or base weights moves them far more. Per strategy: the wall times of
`register()` and `close()`.

    python scripts/bench_cycle.py --model /root/models/qwen2.5-1.5b-shape \\
        --sampling-backend pytorch --strategies sleep/kv_cache sleep/all --json out.json --markdown out.md
    python scripts/bench_cycle.py ... --strategies restart --steps 2 --merge --json out.json --markdown out.md
    python scripts/bench_cycle.py --engine reference --model /tmp/tiny ...   # CPU, shared layout forced
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))  # gpu_helpers
from bench_common import (
    device_name,
    environment,
    markdown_table,
    rollout_workload,
    server_config,
    startup_phases,
    training_bench_parser,
    version_in,
    workload_phrase,
    write_results,
)
from gpu_helpers import MemorySampler

import art_sglang as art
from art_sglang import SGLangBackend, TrainerConfig
from art_sglang.planning.devices import DeviceLayout
from environments.char_share import CharShareTask
from environments.common import train_loop

STRATEGIES = ("sleep/kv_cache", "sleep/all", "restart")
HANDOFF_TEXT = "Write a line of Python that prints a greeting.\nprint('Hello, world!')  # done"
# The reference engine runs on CPU, where no layout is shared on its own: force one, as the tests do.
CPU_SHARED = DeviceLayout("shared", "reference", (), (), "forced on CPU for the benchmark")


def make_backend(args: argparse.Namespace, strategy: str, path: Path) -> SGLangBackend:
    """A backend in shared mode on GPU 0 (or forced on CPU for the reference engine) for `strategy`."""
    handoff, _, release = strategy.partition("/")
    config = server_config(args, **({"sleep_release": release} if release else {}))
    common: dict[str, Any] = {
        "path": str(path),
        "sglang_config": config,
        "trainer_config": TrainerConfig(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank),
        "shared_strategy": handoff,
    }
    if args.engine == "reference":
        return SGLangBackend(layout=CPU_SHARED, **common)
    return SGLangBackend(engine="sglang", inference_device=0, training_devices=[0], **common)


async def served_logprobs(base_url: str, api_key: str | None, name: str | None) -> list[float]:
    """Logprobs the server gives the tokens of HANDOFF_TEXT (teacher-forced, `/generate`) on adapter
    `name` (None: the base model); `base_url` without /v1."""
    body: dict[str, Any] = {
        "text": HANDOFF_TEXT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if name is not None:
        body["lora_path"] = name
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=120, trust_env=False, headers=headers) as http:
        response = await http.post(f"{base_url}/generate", json=body)
    response.raise_for_status()
    return [float(triple[0]) for triple in response.json()["meta_info"]["input_token_logprobs"][1:]]


def logprobs_kept(before: list[float], after: list[float], tolerance: float) -> tuple[bool, float]:
    """(whether `after` is `before` within `tolerance` mean absolute difference, that difference)."""
    if len(before) != len(after) or not before:
        return False, float("inf")
    difference = sum(abs(a - b) for a, b in zip(before, after, strict=True)) / len(before)
    return difference <= tolerance, difference


async def _model_logprobs(model: art.TrainableModel, name: str) -> list[float]:
    assert model.inference_base_url is not None
    return await served_logprobs(model.inference_base_url.removesuffix("/v1"), model.inference_api_key, name)


async def run_strategy(args: argparse.Namespace, strategy: str, steps: int) -> dict[str, Any]:
    art_dir = args.workdir / strategy.replace("/", "-") / ".art"
    backend = make_backend(args, strategy, art_dir)
    model = art.TrainableModel(name="bench", project="bench-cycle", base_model=args.model)
    task = CharShareTask(max_tokens=args.max_tokens)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        await model.register(backend)
        register_s = time.perf_counter() - started
        [server_log] = art_dir.glob("*/models/*/logs/server.log")
        register_profile = startup_phases(server_log.read_text(errors="replace"))
        print(
            f"{strategy} register {register_s:.1f} s, server start: {json.dumps(register_profile)}",
            flush=True,
        )
        for index in range(steps):
            previous = model.get_inference_name()  # the adapter serving now; it stays loaded after the step
            before = await _model_logprobs(model, previous)
            sampler = MemorySampler() if shutil.which("nvidia-smi") else None
            with sampler or contextlib.nullcontext():
                [report] = await train_loop(
                    backend, model, task, steps=1, groups_per_step=args.groups,
                    group_size=args.group_size, learning_rate=args.learning_rate, seed=index,
                )  # fmt: skip
            kept, difference = logprobs_kept(
                before, await _model_logprobs(model, previous), args.logprob_tolerance
            )
            rows.append({"report": report, "step": await model.get_step(), "kept": kept,
                         "logprob_difference": difference, "memory": gpu_memory(sampler)})  # fmt: skip
            print(f"{strategy} step {index + 1}/{steps}: {json.dumps(report.train_metrics)}", flush=True)
    finally:
        closing = time.perf_counter()
        await backend.close()
        close_s = time.perf_counter() - closing
    return {
        **summarize(rows, register_s=register_s, close_s=close_s),
        "register_profile": register_profile,
        "sglang_config": backend.sglang_config.model_dump(),
    }


def gpu_memory(sampler: MemorySampler | None) -> dict[str, int | None]:
    """GPU memory (MiB) during a step, from nvidia-smi samples: the lowest total in use, the server's
    lowest while the trainer held the GPU, the trainer's peak. None without a GPU."""
    samples = sampler.samples if sampler is not None else []
    training = sampler.while_training() if sampler is not None else []
    return {
        "lowest_total": min((sum(s.total.values()) for s in samples), default=None),
        "server_while_training": min((s.server_mib() for s in training), default=None),
        "trainer_peak": max((s.trainer_mib() for s in samples), default=None),
    }


def summarize(rows: list[dict[str, Any]], *, register_s: float, close_s: float) -> dict[str, Any]:
    """Per-step lists (one entry per step, in order) from the steps' TrainResult metrics."""

    def metric(key: str) -> list[float | None]:
        return [row["report"].train_metrics.get(key) for row in rows]

    step_s, train_s = metric("time/step_s"), metric("time/train_s")
    return {
        "steps": len(rows),
        "overhead_s": [s - t for s, t in zip(step_s, train_s, strict=True)],
        "train_s": train_s,
        "step_s": step_s,
        "gpu_release_s": metric("time/gpu_release_s"),
        "gpu_resume_s": metric("time/gpu_resume_s"),
        "sync_s": metric("time/sync_s"),
        "probe_s": metric("time/probe_s"),
        "rollout_s": [row["report"].rollout_s for row in rows],
        "mean_reward": [row["report"].mean_reward for row in rows],
        "step_reached": [row["step"] for row in rows],
        "adapter_kept_after_step": [row["kept"] for row in rows],
        "adapter_logprob_mean_abs_difference": [row["logprob_difference"] for row in rows],
        **{f"gpu_mib_{key}": [row["memory"][key] for row in rows] for key in gpu_memory(None)},
        "register_s": register_s,
        "close_s": close_s,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    previous = json.loads(args.json.read_text()) if args.merge and args.json and args.json.exists() else None
    workload = rollout_workload(args)
    result: dict[str, Any] = previous or {
        "device": device_name(env),
        "date": env["date"],
        "versions": env["versions"],
        "engine": args.engine,
        "model": args.model,
        "workload": workload,
        "strategies": {},
    }
    if previous is not None and (previous["model"], previous["engine"]) != (args.model, args.engine):
        raise SystemExit(
            f"--merge: {args.json} holds results for {previous['engine']} on {previous['model']}, "
            f"not {args.engine} on {args.model}; write to another file"
        )
    if args.engine == "sglang":
        result["versions"]["sglang"] = version_in(server_config(args).resolved_server_python(), "sglang")
    for strategy in args.strategies:
        steps = args.restart_steps if strategy == "restart" else args.steps
        result["strategies"][strategy] = await run_strategy(args, strategy, steps)
    return result


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table(result: dict[str, Any]) -> str:
    headers = ["strategy", "steps", "overhead s/step (median)", "overhead s (min-max)", "train s (median)",
               "release s", "resume s", "sync s", "register s", "close s", "adapter kept (logprobs)",
               "server GPU MiB while training"]  # fmt: skip
    rows = []
    for name, s in result["strategies"].items():
        overhead = s["overhead_s"]
        rows.append([
            name, s["steps"], _median(overhead), f"{min(overhead):.2f}-{max(overhead):.2f}",
            _median(s["train_s"]), _median(s["gpu_release_s"]), _median(s["gpu_resume_s"]),
            _median(s["sync_s"]), s["register_s"], s["close_s"], all(s["adapter_kept_after_step"]),
            _median(s["gpu_mib_server_while_training"]),
        ])  # fmt: skip
    head = (
        f"{result['engine']} on {result['device']}, {result['date']}; model {result['model']}; "
        f"{workload_phrase(result['workload'])}"
    )
    return head + "\n\n" + markdown_table(headers, rows)


def main() -> None:
    parser = training_bench_parser(__doc__)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=3, help="training steps per sleep strategy")
    parser.add_argument("--restart-steps", type=int, default=2, help="training steps with restart")
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        default=0.01,
        help="largest mean absolute change of the previous adapter's served logprobs over a step that "
        "counts as kept (bf16 noise between engines is ~0.001; a lost adapter moves them ~0.1)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="add these strategies to the results already in --json"
    )
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_results(args, result, table(result))


if __name__ == "__main__":
    main()
