"""Loss curves of one model, seed and batch sequence trained on 1 and on N trainer ranks (issue 43: data
parallelism must not change the maths). Each run is a fresh trainer (the same seeded LoRA initialisation)
that trains `--steps` RL steps on one synthetic batch (bench_trainer's gateway-style rollouts, rewards 0/1),
so the loss falls as the policy learns it; a rank count listed twice runs twice, which gives the run-to-run spread the other
counts are held to. Writes `<name>.json` and `<name>.md` into --out.

    python scripts/loss_curves.py --model /root/models/qwen2.5-1.5b-shape --runs 1,1,3 --steps 8 --out DIR
    python scripts/loss_curves.py --runs 1,1,2 --steps 3 --out /tmp/curves     # tiny model, gloo ranks on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, markdown_table
from bench_trainer import parse_run_arguments, synthetic_groups

from art_sglang.config import TrainerConfig
from art_sglang.tiny_model import build_tiny_model
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess

CURVES = ("loss", "grad_norm", "ratio_mean", "num_tokens")


async def curve(
    args: argparse.Namespace, model: str, groups: list[dict[str, Any]], ranks: int, run: int
) -> dict[str, Any]:
    """One fresh trainer on `ranks` ranks, `--steps` steps on the batch: the per-step metrics of `CURVES`."""
    folder = args.work / f"run{run}-{ranks}-ranks"
    config = TrainerConfig(
        use_unsloth=args.gpu,
        lora_rank=args.lora_rank,
        max_seq_length=max(args.seq + 64, args.packing),
        micro_batch_tokens=args.micro_batch_tokens,
        seed=args.seed,
    )
    proc = TrainerProcess(
        model,
        folder / "checkpoints",
        config,
        gpu_ids=list(range(ranks)) if args.gpu else None,
        log_path=folder / "trainer.log",
        cpu_ranks=ranks,
    )
    options = TrainOptions(
        learning_rate=args.learning_rate, save_checkpoint=False, packed_sequence_length=args.packing
    )
    steps: list[dict[str, float]] = []
    started = time.perf_counter()
    try:
        await proc.start()
        for _ in range(args.steps):
            outcome = await proc.train(groups, options)
            steps.append({key: outcome.metrics[key] for key in CURVES})
    finally:
        await proc.stop()
    return {
        "run": run,
        "ranks": ranks,
        "backend": proc.info.get("backend"),
        "seconds": time.perf_counter() - started,
        "steps": steps,
    }


def spread(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    """The largest relative difference of two runs' `key` over the steps."""
    return max(
        abs(x[key] - y[key]) / max(abs(x[key]), abs(y[key]), 1e-12)
        for x, y in zip(a["steps"], b["steps"], strict=True)
    )


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model, built offline)")
    parser.add_argument("--runs", default="1,1,3", help="rank count of each run, in order")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=48, help="trajectories per step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per trajectory (about)")
    parser.add_argument("--packing", type=int, default=24576, help="packed_sequence_length (a row's tokens)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="the trainer's seed (LoRA initialisation)")
    parser.add_argument("--name", default="loss_curves", help="file name of the JSON and markdown")
    args = parse_run_arguments(parser)
    model = args.model or str(build_tiny_model(args.work / "tiny-model"))
    groups = synthetic_groups(model, args.batch, args.seq)
    runs = [await curve(args, model, groups, int(r), n) for n, r in enumerate(args.runs.split(","))]
    first = runs[0]
    for other in runs[1:]:
        other["largest_relative_difference_to_run_0"] = {key: spread(first, other, key) for key in CURVES}
    report = {
        "model": model,
        **{k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "runs": runs,
        "environment": environment(),
    }
    header = ["step", *(f"run {r['run']}: {r['ranks']} rank(s) {key}" for r in runs for key in CURVES[:2])]
    rows = [
        [step + 1, *(r["steps"][step][key] for r in runs for key in CURVES[:2])] for step in range(args.steps)
    ]
    table = (
        f"Loss curves, {args.batch} trajectories x {args.seq} tokens per step (the same batch each step), rows of "
        f"{args.packing} tokens, LoRA r={args.lora_rank}, learning rate {args.learning_rate}, model {model}\n\n"
        + markdown_table(header, rows)
        + "\n\nLargest relative difference to run 0 over the steps:\n\n"
        + markdown_table(
            ["run", "ranks", *CURVES],
            [
                [r["run"], r["ranks"], *(r["largest_relative_difference_to_run_0"][k] for k in CURVES)]
                for r in runs[1:]
            ],
        )
    )
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"{args.name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    asyncio.run(main())
