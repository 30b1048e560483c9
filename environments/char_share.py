"""Character-share task: the reward is the share of an answer's characters that belong to a character
class (by default the vowels). Any model can raise it by shifting probability to tokens rich in that
class, so even a tiny random model learns it within a few steps: a fast end-to-end check of rollouts,
training and weight sync.

Run it: `python -m environments.char_share --base-model PATH` (see scripts/demo.py for the full demo).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import art_sglang as art

PROMPTS = ("Write a short sentence.", "Say something.", "Describe the sea.", "Name a colour.")


@dataclass(frozen=True)
class CharShareTask:
    """Which characters are rewarded, and how rollouts are sampled."""

    chars: str = "aeiou"
    prompts: tuple[str, ...] = PROMPTS
    max_tokens: int = 12
    temperature: float = 1.0

    def reward(self, text: str) -> float:
        """Share of the non-whitespace characters of `text` in the class; 0 for an empty answer."""
        visible = [c for c in text if not c.isspace()]
        if not visible:
            return 0.0
        return sum(c.lower() in self.chars for c in visible) / len(visible)


async def rollout(model: Any, task: CharShareTask, prompt: str, seed: int) -> art.Trajectory:
    """One chat completion on the model's current step, scored by the task."""
    messages = [{"role": "user", "content": prompt}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=task.max_tokens,
        temperature=task.temperature,
        logprobs=True,
        seed=seed,
        # The ids the server sampled, so the trainer trains on exactly them (the gateway asks for them on
        # its own; asking here too keeps a rollout without the gateway exact).
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    reward = task.reward(choice.message.content or "")
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=reward,
        metrics={"share": reward},
        metadata={"seed": seed},
    )


@dataclass
class StepReport:
    """One round: `step` is the model step whose adapter produced the rollouts (trained into step+1)."""

    step: int
    mean_reward: float
    rollout_s: float
    train_s: float
    metrics: dict[str, float] = field(default_factory=dict)


async def train_loop(
    backend: Any,
    model: Any,
    task: CharShareTask,
    *,
    steps: int,
    groups_per_step: int = 8,
    group_size: int = 8,
    learning_rate: float = 5e-2,
    seed: int = 0,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """`steps` rounds of rollouts and `backend.train`; seeds depend only on (seed, step, group, index),
    so a run is reproducible."""
    reports = []
    for step in range(steps):
        served = await model.get_step()
        started = time.monotonic()
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, task, task.prompts[g % len(task.prompts)], _seed(seed, step, g, i))
                    for i in range(group_size)
                )
                for g in range(groups_per_step)
            ),
            pbar_desc=f"rollouts step {step}",
        )
        rollout_s = time.monotonic() - started
        for group in groups:  # completion order varies from run to run; the seed order does not
            group.trajectories.sort(key=lambda t: t.metadata["seed"])
        mean = statistics.fmean(t.reward for g in groups for t in g.trajectories)
        result = await backend.train(model, groups, learning_rate=learning_rate)
        train_s = result.metrics.get("time/step_s", 0.0)
        report = StepReport(served, mean, rollout_s, train_s, result.metrics)
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports


def _seed(seed: int, step: int, group: int, index: int) -> int:
    return ((seed * 1000 + step) * 100 + group) * 100 + index


def print_report(report: StepReport) -> None:
    print(
        f"step {report.step:3d}  mean reward {report.mean_reward:.3f}  "
        f"rollouts {report.rollout_s:5.2f} s  train+sync {report.train_s:5.2f} s",
        flush=True,
    )


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args(argv)
    model = art.TrainableModel(name="char-share", project="environments", base_model=args.base_model)
    async with art.SGLangBackend(path=args.path) as backend:
        await model.register(backend)
        await train_loop(backend, model, CharShareTask(), steps=args.steps, on_step=print_report)


if __name__ == "__main__":
    asyncio.run(main())
