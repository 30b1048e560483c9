"""The demo: RL on the character-share task (environments/char_share.py) through SGLangBackend, printing
the mean reward and the timings of every step.

Without --model it builds the tiny offline model and runs on CPU through the reference engine (a few
minutes on 2 cores; the reward rises within ~10 steps). With --model and a GPU it drives real SGLang.

    python scripts/demo.py                                   # CPU, tiny model
    python scripts/demo.py --model Qwen/Qwen2.5-0.5B-Instruct --learning-rate 1e-5 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ from a source checkout

import art_sglang as art
from art_sglang.config import DEFAULT_LORA_TARGETS, TrainerConfig
from art_sglang.tiny_model import build_tiny_model
from environments.char_share import CharShareTask, StepReport, print_report, train_loop

# A random tiny model's output head is fixed and nearly uniform: LoRA on the transformer layers alone
# cannot move its logits much, so on the tiny model the head gets an adapter too, and a large rate.
TINY_LEARNING_RATE = 5e-2
TINY_TARGETS = [*DEFAULT_LORA_TARGETS, "lm_head"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="base model (HF id or path); default: the tiny offline model")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=8, help="trajectory groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["auto", "sglang", "reference"], default="auto")
    parser.add_argument("--path", default=".art", help="where models, checkpoints and logs go")
    parser.add_argument("--resume", action="store_true", help="continue an earlier demo run")
    parser.add_argument("--json", type=Path, help="write the per-step results here")
    parser.add_argument(
        "--tiny-model-dir", type=Path, help="where the tiny model is built (default PATH/tiny-model)"
    )
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> list[StepReport]:
    root = Path(args.path)
    tiny = args.model is None
    tiny_dir = args.tiny_model_dir or root / "tiny-model"
    base_model = str(build_tiny_model(tiny_dir)) if tiny else args.model
    learning_rate = args.learning_rate or (TINY_LEARNING_RATE if tiny else 1e-5)
    model = art.TrainableModel(name="char-share", project="demo", base_model=base_model)
    model_dir = root / model.project / "models" / model.name
    if model_dir.exists() and not args.resume:
        print(f"starting over: removing the earlier demo run in {model_dir} (--resume keeps it)")
        shutil.rmtree(model_dir)
    trainer_config = TrainerConfig(target_modules=TINY_TARGETS, seed=args.seed) if tiny else None
    started = time.monotonic()
    async with art.SGLangBackend(
        path=str(root), engine=args.engine, trainer_config=trainer_config
    ) as backend:
        await model.register(backend)
        print(f"{backend.layout.describe()}; serving {model.get_inference_name()}", flush=True)
        print(f"registered in {time.monotonic() - started:.1f} s", flush=True)
        reports = await train_loop(
            backend,
            model,
            CharShareTask(),
            steps=args.steps,
            groups_per_step=args.groups,
            group_size=args.group_size,
            learning_rate=learning_rate,
            seed=args.seed,
            on_step=print_report,
        )
    first, last = reports[0].mean_reward, reports[-1].mean_reward
    print(
        f"mean reward {first:.3f} -> {last:.3f} in {len(reports)} steps, {time.monotonic() - started:.0f} s"
    )
    if args.json is not None:
        rows = [
            {"step": r.step, "mean_reward": r.mean_reward, "rollout_s": r.rollout_s, "train_s": r.train_s}
            for r in reports
        ]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return reports


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
