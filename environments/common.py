"""What every environment shares: the training loop and the command line that
`python -m environments.<name>` and scripts/demo.py run.

A run trains `model` for `--steps` rounds: each round gathers `--groups` groups of `--group-size`
rollouts (one scenario per group), logs them with `model.log(groups, split="train")` as an ART program
does, and calls `backend.train`. At the end the per-step rewards go to `rewards.json` and
`reward_curve.png` next to the run's history.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import art_sglang as art
from art_sglang.config import DEFAULT_LORA_TARGETS, SGLangConfig, TrainerConfig
from art_sglang.tiny_model import build_tiny_model
from art_sglang.training.options import TrainOptions

from .environment import Environment, StepReport, rollout_seed
from .reward_curve import write_results

# A random tiny model's output head is fixed and nearly uniform: LoRA on the transformer layers alone
# cannot move its logits much, so on the tiny model the head gets an adapter too, and a large rate. Not
# larger: AdamW moves every adapter weight by about the rate each step, however small the reward
# differences, and at 5e-2 the policy became certain of one token (char_share: "ian" repeated, 2/3 for
# good) before the tokens of the task's ceiling had any weight; at 2e-2 it keeps exploring all the way up.
TINY_LEARNING_RATE = 2e-2
TINY_TARGETS = [*DEFAULT_LORA_TARGETS, "lm_head"]
REAL_LEARNING_RATE = 1e-5


async def train_loop(
    backend: Any,
    model: Any,
    env: Environment,
    *,
    steps: int,
    groups_per_step: int = 8,
    group_size: int = 8,
    learning_rate: float = TINY_LEARNING_RATE,
    seed: int = 0,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """`steps` rounds of rollouts, `model.log` and `backend.train`; fewer when every rollout of a round
    scores the environment's `ceiling` (an optional attribute): the task is solved, and a flat batch
    has nothing left to teach."""
    ceiling: float | None = getattr(env, "ceiling", None)
    reports = []
    for round_ in range(steps):
        served = await model.get_step()
        started = time.monotonic()
        scenarios = env.scenarios(served, groups_per_step, seed)
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    env.rollout(model, scenario, rollout_seed(seed, round_, g, i)) for i in range(group_size)
                )
                for g, scenario in enumerate(scenarios)
            ),
            pbar_desc=f"rollouts step {served}",
        )
        rollout_s = time.monotonic() - started
        for group in groups:  # completion order varies from run to run; the seed order does not
            group.trajectories.sort(key=lambda t: t.metadata["seed"])
        trajectories = [t for g in groups for t in g.trajectories]
        await model.log(groups, split="train")
        rewards = [t.reward for t in trajectories]
        solved = ceiling is not None and min(rewards) >= ceiling
        train_metrics = (
            {} if solved else dict((await backend.train(model, groups, learning_rate=learning_rate)).metrics)
        )
        names = sorted({name for t in trajectories for name in t.metrics})
        metrics = {
            name: statistics.fmean(float(t.metrics[name]) for t in trajectories if name in t.metrics)
            for name in names
        }
        report = StepReport(
            served, rewards, rollout_s, train_metrics.get("time/step_s", 0.0), metrics, train_metrics, solved
        )
        reports.append(report)
        if on_step is not None:
            on_step(report)
        if solved:
            break
    return reports


def print_report(report: StepReport) -> None:
    """The step's line; a step that took no optimizer step (its groups carried no signal; the backend's
    warning says why, once) is marked."""
    untrained = report.train_metrics.get("gradient_steps") == 0.0
    print(
        f"step {report.step:3d}  mean reward {report.mean_reward:.3f}  "
        f"rollouts {report.rollout_s:5.2f} s  train+sync {report.train_s:5.2f} s"
        + ("  (not trained: no signal)" if untrained else ""),
        flush=True,
    )
    if report.solved:
        print(
            f"solved: all {len(report.rewards)} rollouts of step {report.step} scored the task's best reward "
            f"({report.mean_reward:.3f}), so there is nothing left to learn; stopping here",
            flush=True,
        )


def parse_args(description: str, argv: Sequence[str] | None, *, steps: int = 12) -> argparse.Namespace:
    """The command line every environment takes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--model", "--base-model", dest="model",
        help="base model (HF id or path); default: the tiny offline model (CPU demo scale)",
    )  # fmt: skip
    parser.add_argument(
        "--steps",
        type=int,
        default=steps,
        help=f"at most this many (default {steps}); a run stops earlier once every rollout of a step\n"
        "scores the task's best reward",
    )
    parser.add_argument("--groups", type=int, default=8, help="trajectory groups (scenarios) per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per scenario")
    parser.add_argument(
        "--learning-rate", type=float, help=f"default {TINY_LEARNING_RATE} (tiny), {REAL_LEARNING_RATE}"
    )
    parser.add_argument("--max-tokens", type=int, help="tokens per model turn; default: the environment's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default=".art", help="where models, checkpoints and logs go")
    parser.add_argument("--resume", action="store_true", help="continue an earlier run of this model")
    parser.add_argument("--json", type=Path, help="also write the per-step results here")
    parser.add_argument("--tiny-model-dir", type=Path, help="where the tiny model is built (PATH/tiny-model)")
    parser.add_argument(
        "--pipelined",
        type=int,
        metavar="MAX_STEPS_OFF_POLICY",
        help="train with ART's PipelineTrainer (openpipe-art installed): rollouts go on while the trainer\n"
        "trains, at most this many steps behind (one GPU: with --shared-strategy co_resident)",
    )
    backend = parser.add_argument_group("backend")
    backend.add_argument("--engine", choices=["auto", "sglang", "reference"], default="auto")
    backend.add_argument("--shared-strategy", choices=["sleep", "restart", "co_resident"], default="sleep")
    backend.add_argument("--weight-sync", choices=["lora", "disk", "restart"], default="lora")
    backend.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args(argv)
    if args.learning_rate is not None:  # refused now, not after step 0's rollouts
        try:
            TrainOptions.from_keywords({"learning_rate": args.learning_rate})
        except art.ConfigError as exc:
            parser.error(f"--learning-rate {args.learning_rate}: {exc}")
    return args


def tiny_model_note(env: Environment) -> str | None:
    """What a run of `env` on the tiny model should say first: None where the tiny model learns it."""
    if getattr(env, "tiny_model_learns", False):
        return None
    return (
        f"note: without --model this runs the tiny random model, which checks the loop but cannot learn "
        f"{env.name} (its reward stays near chance). To see it learn, pass --model with a real model (on a "
        "GPU); scripts/demo.py runs a task that the tiny model learns on CPU."
    )


async def run(
    env: Environment, args: argparse.Namespace, *, project: str = "environments"
) -> list[StepReport]:
    """Train `env` as the command line says; print each step and where the results are."""
    root = Path(args.path)
    tiny = args.model is None
    base_model = str(build_tiny_model(args.tiny_model_dir or root / "tiny-model")) if tiny else args.model
    learning_rate = args.learning_rate or (TINY_LEARNING_RATE if tiny else REAL_LEARNING_RATE)
    note = tiny_model_note(env) if tiny else None
    if note is not None:
        print(note, flush=True)
    if args.max_tokens is not None:
        env = dataclasses.replace(env, max_tokens=args.max_tokens)  # type: ignore[type-var]
    if args.pipelined is None:
        model = art.TrainableModel(name=env.name, project=project, base_model=base_model)
    else:
        from .pipelined import openpipe_art  # PipelineTrainer keeps its state with ART's own model class

        model = openpipe_art().TrainableModel(name=env.name, project=project, base_model=base_model)
    model_dir = root / project / "models" / model.name
    if model_dir.exists() and not args.resume:
        print(f"starting over: removing the earlier run in {model_dir} (--resume keeps it)")
        shutil.rmtree(model_dir)
    trainer_config = TrainerConfig(
        lora_rank=args.lora_rank, seed=args.seed, **({"target_modules": TINY_TARGETS} if tiny else {})
    )
    started = time.monotonic()
    async with art.SGLangBackend(
        path=str(root),
        engine=args.engine,
        shared_strategy=args.shared_strategy,
        sglang_config=SGLangConfig(weight_sync_method=args.weight_sync, max_steps_off_policy=args.pipelined),
        trainer_config=trainer_config,
    ) as backend:
        await model.register(backend)
        # The layout is in the backend's log line above.
        print(
            f"serving {model.get_inference_name()}: registered in {time.monotonic() - started:.1f} s",
            flush=True,
        )
        loop_options: dict[str, Any] = {
            "steps": args.steps,
            "groups_per_step": args.groups,
            "group_size": args.group_size,
            "learning_rate": learning_rate,
            "seed": args.seed,
            "on_step": print_report,
        }
        if args.pipelined is None:
            reports = await train_loop(backend, model, env, **loop_options)
        else:
            from .pipelined import pipelined_loop

            reports = await pipelined_loop(
                backend, model, env, max_steps_off_policy=args.pipelined, **loop_options
            )
    first, last = reports[0].mean_reward, reports[-1].mean_reward
    print(
        f"mean reward {first:.3f} -> {last:.3f} in {len(reports)} steps, {time.monotonic() - started:.0f} s"
    )
    rows = [report.row() for report in reports]
    results, png = write_results(model_dir, rows, title=f"{project}/{model.name}: reward per step")
    print(f"per-step results: {results}")
    print(f"reward curve: {png}" if png else "reward curve: not drawn (pip install matplotlib)")
    print(f"history: {model_dir / 'history.jsonl'}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return reports


def main(
    env: Environment,
    description: str,
    argv: Sequence[str] | None = None,
    *,
    steps: int = 12,
    **run_options: Any,
) -> None:
    """Entry point of `python -m environments.<name>`; `steps` is the default of --steps."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "matplotlib"):  # a line per request; the font cache's first build
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        asyncio.run(run(env, parse_args(description, argv, steps=steps), **run_options))
    except art.ConfigError as exc:  # a setting to change: the message says which and how
        raise SystemExit(f"error: {exc}") from None
