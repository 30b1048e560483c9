"""Trainer throughput: tokens/s of one training step on the same synthetic batch, through the real
worker process, for the transformers + peft path and (with a GPU and unsloth installed) the Unsloth
path. With `--ranks 1,2` each path runs once per rank count (data parallelism, one GPU per rank; gloo
ranks on CPU) on the same batch. Writes `<name>.json` and `<name>.md` into --out.

    python scripts/bench_trainer.py --model /root/models/qwen2.5-1.5b-shape --batch 8 --seq 512 --steps 5 --out docs/results
    python scripts/bench_trainer.py --out /tmp/bench        # tiny model, built offline, peft only on CPU
    python scripts/bench_trainer.py --model M --backends unsloth --ranks 1,2 --name bench_trainer_ddp --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, markdown_table

from art_sglang.config import TrainerConfig
from art_sglang.tiny_model import build_tiny_model
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess


def synthetic_groups(model: str, batch: int, seq: int, seed: int = 0) -> list[dict[str, Any]]:
    """One group of `batch` trajectories, each a short prompt plus an answer of `seq` - 32 random tokens,
    sent as the gateway returns a rollout (the sampled ids and a logprob entry per token, as large as the
    backend's real requests); rewards alternate 0/1 so every trajectory is trained."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    # About a random model's logprob of a sampled token, so the importance ratios start near 1.
    logprob = -math.log(len(vocab))
    trajectories = []
    for index in range(batch):
        ids = [rng.choice(vocab) for _ in range(max(seq - 32, 1))]
        pieces = [tokenizer.decode([i]) for i in ids]
        choice = {
            "index": 0,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": "".join(pieces)},
            "logprobs": {
                "content": [
                    {"token": t, "bytes": list(t.encode()), "logprob": logprob, "top_logprobs": []}
                    for t in pieces
                ]
            },
            "token_ids": ids,
        }
        trajectories.append(
            {
                "messages_and_choices": [{"role": "user", "content": f"Task {index}."}, choice],
                "reward": float(index % 2),
            }
        )
    return [{"trajectories": trajectories}]


async def bench_backend(
    args: argparse.Namespace, model: str, unsloth: bool, groups: list[dict[str, Any]], ranks: int
) -> list[dict[str, Any]]:
    """One trainer (one load) timed on the batch with each packing of `--packings`."""
    backend = "unsloth" if unsloth else "peft"
    folder = args.work / f"{backend}-{ranks}-ranks"
    # A fresh trainer: one left by an earlier run (another model) would be resumed, or refused.
    shutil.rmtree(folder, ignore_errors=True)
    config = TrainerConfig(
        use_unsloth=unsloth,
        lora_rank=args.lora_rank,
        max_seq_length=max([args.seq + 64, *(p for p in args.packings if p is not None)]),
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing={"on": True, "off": False, "default": None}[args.gradient_checkpointing],
    )
    gpus = list(range(ranks)) if args.gpu else None
    proc = TrainerProcess(
        model, folder / "checkpoints", config, gpu_ids=gpus, log_path=folder / "trainer.log", cpu_ranks=ranks
    )
    results = []
    started = time.perf_counter()
    try:
        await proc.start()
        load_s = time.perf_counter() - started
        for packing in args.packings:
            options = TrainOptions(
                learning_rate=1e-5,
                save_checkpoint=False,
                packed_sequence_length=packing,
            )
            await proc.train(groups, options)  # warm-up: kernels, allocator, compilation
            steps = []
            for _ in range(args.steps):
                await asyncio.sleep(args.gap_s)  # a synchronous loop's rollouts: the background writes end
                begin = time.perf_counter()
                outcome = await proc.train(groups, options)
                steps.append((time.perf_counter() - begin, outcome.metrics))
            results.append({"packed_sequence_length": packing, **_summary(steps)})
    except Exception as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"[:3000]})
    finally:
        await proc.stop()
    common = {"backend": proc.info.get("backend", backend), "ranks": ranks, "device": proc.info.get("device")}
    return [{**common, "load_s": load_s, **r} if "error" not in r else {**common, **r} for r in results]


def _summary(steps: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """The timed steps: `step_s` and `phases_s` are means over all of them; `steady_step_s` leaves the first
    out (it can carry one-off costs: the warm-up step's background write, a late compilation), and the
    `_each` lists keep every step's own numbers."""
    tokens = sum(m["num_tokens"] for _, m in steps)
    # Counted by the trainer: a rate times `seconds` was not, the rate being over the optimizer steps only.
    forwarded = sum(m["num_tokens_forwarded"] for _, m in steps)
    walls = [s for s, _ in steps]
    wall = sum(walls)
    steady = walls[1:] or walls
    each = [step_phases(seconds, metrics) for seconds, metrics in steps]
    return {
        "step_s": wall / len(steps),
        "steady_step_s": statistics.fmean(steady),
        "step_s_median": statistics.median(walls),
        "step_s_each": walls,
        "train_tokens_per_s": tokens / wall,
        "forward_tokens_per_s": sum(m["tokens_per_second"] for _, m in steps) / len(steps),
        "tokens_per_step": forwarded / len(steps),
        "padded_tokens_per_step": sum(m["num_tokens_padded"] for _, m in steps) / len(steps),
        "trained_tokens_per_step": tokens / len(steps),
        "optimizer_steps": steps[-1][1]["gradient_steps"],
        "micro_batches": steps[-1][1]["micro_batches"],
        "gpu_peak_memory_gb": max((m.get("gpu_peak_memory_gb", 0.0) for _, m in steps), default=0.0),
        "phases_s": mean_phases(each),
        "phases_s_each": each,
        "checkpoint_parts_s": {  # rank 0's checkpoint phase in parts, means (trainer.py)
            name.removeprefix("time/checkpoint_").removesuffix("_s"): statistics.fmean(
                m.get(name, 0.0) for _, m in steps
            )
            # In the writer's order (the metrics keep it): checkpoint_writer.py's `seconds` names the parts.
            for name in dict.fromkeys(k for _, m in steps for k in m if k.startswith("time/checkpoint_"))
        },
    }


def step_phases(wall: float, metrics: dict[str, float]) -> dict[str, float]:
    """Where one step's time went: the trainer's own phases (rank 0's, and the slowest and fastest rank's
    where the trainer reports them), `other_in_trainer` (the trainer's time outside the named phases) and
    `outside_trainer`: the rest of the step's wall time as the caller saw it (the request's JSON out and
    in, its pipe, the ranks receiving it, the answer)."""
    out = {
        name.removeprefix("time/trainer_").removesuffix("_s"): value
        for name, value in metrics.items()
        if name.startswith("time/trainer_")
    }
    # The checkpoint comes after `seconds` is taken; the ranks' spread is not rank 0's time.
    counted = [
        v for k, v in out.items() if k != "checkpoint" and not k.endswith(("_slowest_rank", "_fastest_rank"))
    ]
    out["other_in_trainer"] = metrics["seconds"] - sum(counted)
    out["outside_trainer"] = wall - metrics["seconds"] - out.get("checkpoint", 0.0)
    return out


def mean_phases(each: list[dict[str, float]]) -> dict[str, float]:
    """The timed steps' `step_phases` averaged (a phase a step lacks counts as 0 s there)."""
    names = sorted({name for step in each for name in step} - {"other_in_trainer", "outside_trainer"})
    return {
        name: statistics.fmean(step.get(name, 0.0) for step in each)
        for name in [*names, "other_in_trainer", "outside_trainer"]
    }


def parse_run_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with `--work` and `--out` added, the out folder made, and `gpu` (torch sees one)."""
    parser.add_argument("--work", type=Path, default=None, help="models and checkpoints (default: OUT/work)")
    parser.add_argument("--out", type=Path, required=True, help="folder for <name>.json/.md")
    args = parser.parse_args()
    import torch

    args.gpu = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or args.out / "work"
    return args


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model, built offline)")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per trajectory (about)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument(
        "--gap-s",
        type=float,
        default=0.0,
        help="idle seconds before each timed step, as a synchronous RL loop's rollouts take (the previous "
        "step's optimizer state, written in the background on rank 0, is then on disk before the step starts)",
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--gradient-checkpointing",
        choices=["default", "on", "off"],
        default="default",
        help="TrainerConfig.gradient_checkpointing (default: on with a GPU): off trades memory for the "
        "recomputed forward of every backward",
    )
    parser.add_argument("--backends", default="auto", help="peft,unsloth | auto (unsloth only with a GPU)")
    parser.add_argument("--ranks", default="1", help="trainer rank counts to compare, e.g. 1,2")
    parser.add_argument("--name", default="bench_trainer", help="file name of the JSON and markdown")
    parser.add_argument(
        "--packings",
        default="default",
        help="packed_sequence_length values to time, comma-separated; 'default' = ART's (the longest "
        "sequence rounded up to 2048): with more ranks a step gains only where a row holds several sequences",
    )
    args = parse_run_arguments(parser)
    args.packings = [None if p == "default" else int(p) for p in args.packings.split(",")]
    model = args.model or str(build_tiny_model(args.work / "tiny-model"))
    backends = (
        ["peft", "unsloth"]
        if args.backends == "auto" and args.gpu
        else ["peft"]
        if args.backends == "auto"
        else args.backends.split(",")
    )
    groups = synthetic_groups(model, args.batch, args.seq)
    counts = [int(n) for n in args.ranks.split(",")]
    results = [
        result
        for name in backends
        for ranks in counts
        for result in await bench_backend(args, model, name == "unsloth", groups, ranks)
    ]
    for result in results:  # against the same path and packing on one rank
        same = ("backend", "packed_sequence_length")
        single = next(
            (r for r in results if r["ranks"] == 1 and all(r.get(k) == result.get(k) for k in same)), {}
        )
        if "train_tokens_per_s" in result and "train_tokens_per_s" in single:
            result["speedup_vs_1_rank"] = result["train_tokens_per_s"] / single["train_tokens_per_s"]
            # Same batch on every rank count: the ratio of step times after each run's first timed step.
            result["steady_speedup_vs_1_rank"] = single["steady_step_s"] / result["steady_step_s"]
    report = {
        "model": model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "lora_rank": args.lora_rank,
        "micro_batch_tokens": args.micro_batch_tokens,
        "gradient_checkpointing": args.gradient_checkpointing,
        "gap_s": args.gap_s,
        "results": results,
        "environment": environment(),
    }
    rows = [
        [
            r.get("backend"),
            r.get("packed_sequence_length") or "default",
            r["ranks"],
            r.get("device", "-"),
            r.get("load_s", "-"),
            r.get("optimizer_steps", "-"),
            r.get("micro_batches", "-"),
            r.get("step_s", "-"),
            r.get("steady_step_s", "-"),
            r.get("train_tokens_per_s", "-"),
            r.get("forward_tokens_per_s", "-"),
            r.get("speedup_vs_1_rank", "-"),
            r.get("steady_speedup_vs_1_rank", "-"),
            r.get("gpu_peak_memory_gb", "-"),
            r.get("error", ""),
        ]
        for r in results
    ]
    header = f"Trainer step, {args.batch} trajectories x {args.seq} tokens (gateway-style: ids and a logprob per token), LoRA r={args.lora_rank}, model {model}\n\n"
    table = header + markdown_table(
        [
            "path",
            "packed row",
            "ranks",
            "device",
            "load s",
            "optimizer steps",
            "micro-batches (all ranks)",
            "step s (mean)",
            "step s after the first",
            "trained tokens/s",
            "forward tokens/s",
            "× 1 rank (mean)",
            "× 1 rank (after the first)",
            "peak GPU GB (fullest rank)",
            "error",
        ],
        rows,
    )
    parts = list(dict.fromkeys(part for r in results for part in r.get("checkpoint_parts_s", {})))
    table += (
        "\n\nWhere a step's time went, seconds (means over the timed steps; rank 0's phases):\n\n"
        + phase_table(results)
        + "\n\nEach timed step (the first can carry one-off costs; `steady_step_s` leaves it out):\n\n"
        + phase_table(results, each=True)
        + "\n\nRank 0's checkpoint phase in parts, seconds (means): waiting for the previous step's background "
        + "work (fsyncs, optimizer state), the adapter's host copies, adapter_model.safetensors, the other published files "
        + "and optimizer.pt's reserve, their rename:\n\n"
        + markdown_table(
            ["path", "ranks", "checkpoint", *parts],
            [
                [r["backend"], r["ranks"], r["phases_s"].get("checkpoint", "-")]
                + [r["checkpoint_parts_s"].get(part, "-") for part in parts]
                for r in results
                if "checkpoint_parts_s" in r
            ],
        )
    )
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"{args.name}.md").write_text(table + "\n")
    print(table)


def phase_table(results: list[dict[str, Any]], *, each: bool = False) -> str:
    """Seconds per phase: the means per run, or (`each`) a row per timed step."""
    timed = [r for r in results if "phases_s" in r]
    names = sorted({name for r in timed for name in r["phases_s"]})
    runs = [
        (r, f"{index + 1}" if each else "mean", step_s, phases)
        for r in timed
        for index, (step_s, phases) in enumerate(
            zip(r["step_s_each"], r["phases_s_each"], strict=True) if each else [(r["step_s"], r["phases_s"])]
        )
    ]
    rows = [
        [r["backend"], r.get("packed_sequence_length") or "default", r["ranks"], step, step_s]
        + [phases.get(name, "-") for name in names]
        for r, step, step_s, phases in runs
    ]
    return markdown_table(["path", "packed row", "ranks", "timed step", "step s", *names], rows)


if __name__ == "__main__":
    asyncio.run(main())
