"""Trainer throughput: tokens/s of one training step on the same synthetic batch, through the real
worker process, for the transformers + peft path and (with a GPU and unsloth installed) the Unsloth
path. Writes `bench_trainer.json` and `bench_trainer.md` into --out.

    python scripts/bench_trainer.py --model /root/models/qwen2.5-1.5b-shape --batch 8 --seq 512 --steps 5 --out docs/results
    python scripts/bench_trainer.py --out /tmp/bench        # tiny model, built offline, peft only on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
    """One group of `batch` trajectories, each a short prompt plus an answer of about `seq` tokens of
    random text; rewards alternate 0/1 so every trajectory is trained."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    trajectories = []
    for index in range(batch):
        ids = tokenizer.encode(
            tokenizer.decode([rng.choice(vocab) for _ in range(seq)]), add_special_tokens=False
        )
        text = tokenizer.decode(ids[: max(seq - 32, 1)])
        choice = {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
        }
        trajectories.append(
            {
                "messages_and_choices": [{"role": "user", "content": f"Task {index}."}, choice],
                "reward": float(index % 2),
            }
        )
    return [{"trajectories": trajectories}]


async def bench_backend(
    args: argparse.Namespace, model: str, unsloth: bool, groups: list[dict[str, Any]]
) -> dict[str, Any]:
    folder = args.out / "work" / ("unsloth" if unsloth else "peft")
    config = TrainerConfig(
        use_unsloth=unsloth,
        lora_rank=args.lora_rank,
        max_seq_length=args.seq + 64,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    gpus = [0] if args.gpu else None
    proc = TrainerProcess(
        model, folder / "checkpoints", config, gpu_ids=gpus, log_path=folder / "trainer.log"
    )
    options = TrainOptions(learning_rate=1e-5, allow_training_without_logprobs=True, save_checkpoint=False)
    started = time.perf_counter()
    try:
        await proc.start()
        load_s = time.perf_counter() - started
        await proc.train(groups, options)  # warm-up: kernels, allocator, compilation
        steps = []
        for _ in range(args.steps):
            begin = time.perf_counter()
            outcome = await proc.train(groups, options)
            steps.append((time.perf_counter() - begin, outcome.metrics))
    except Exception as exc:
        return {"backend": "unsloth" if unsloth else "peft", "error": f"{type(exc).__name__}: {exc}"[:3000]}
    finally:
        await proc.stop()
    tokens = sum(m["num_tokens"] for _, m in steps)
    forwarded = sum(m["tokens_per_second"] * m["seconds"] for _, m in steps)
    wall = sum(s for s, _ in steps)
    return {
        "backend": proc.info.get("backend"),
        "device": proc.info.get("device"),
        "load_s": load_s,
        "step_s": wall / len(steps),
        "train_tokens_per_s": tokens / wall,
        "forward_tokens_per_s": sum(m["tokens_per_second"] for _, m in steps) / len(steps),
        "tokens_per_step": forwarded / len(steps),
        "trained_tokens_per_step": tokens / len(steps),
        "gpu_peak_memory_gb": max((m.get("gpu_peak_memory_gb", 0.0) for _, m in steps), default=0.0),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model, built offline)")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per trajectory (about)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--backends", default="auto", help="peft,unsloth | auto (unsloth only with a GPU)")
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_trainer.json/.md")
    args = parser.parse_args()
    import torch

    args.gpu = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_tiny_model(args.out / "work" / "tiny-model"))
    backends = (
        ["peft", "unsloth"]
        if args.backends == "auto" and args.gpu
        else ["peft"]
        if args.backends == "auto"
        else args.backends.split(",")
    )
    groups = synthetic_groups(model, args.batch, args.seq)
    results = [await bench_backend(args, model, name == "unsloth", groups) for name in backends]
    report = {
        "model": model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "lora_rank": args.lora_rank,
        "results": results,
        "environment": environment(),
    }
    rows = [
        [
            r.get("backend"),
            r.get("device", "-"),
            r.get("load_s", "-"),
            r.get("step_s", "-"),
            r.get("train_tokens_per_s", "-"),
            r.get("forward_tokens_per_s", "-"),
            r.get("gpu_peak_memory_gb", "-"),
            r.get("error", ""),
        ]
        for r in results
    ]
    header = f"Trainer step, {args.batch} trajectories x ~{args.seq} tokens, LoRA r={args.lora_rank}, model {model}\n\n"
    table = header + markdown_table(
        [
            "path",
            "device",
            "load s",
            "step s",
            "trained tokens/s",
            "forward tokens/s",
            "peak GPU GB",
            "error",
        ],
        rows,
    )
    (args.out / "bench_trainer.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "bench_trainer.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    asyncio.run(main())
