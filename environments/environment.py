"""What an environment is (`Environment`), what one round of training reports (`StepReport`), and the
rollout helpers every environment uses; the loops (environments/common.py and environments/pipelined.py)
and the tasks import this module, so neither loop imports the other's module to learn these shapes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import art_sglang as art


class Environment(Protocol):
    """A task: scenarios for each step and a rollout that turns one scenario into a scored trajectory.
    Optional attributes: `ceiling` (the best reward: a step that scores it everywhere ends the run) and
    `tiny_model_learns` (False when absent: a run on the tiny model says up front that it cannot learn)."""

    name: str
    max_tokens: int

    def scenarios(self, step: int, count: int, seed: int) -> Sequence[Any]: ...

    async def rollout(self, model: Any, scenario: Any, seed: int) -> art.Trajectory: ...


@dataclass
class StepReport:
    """One round: `step` is the model step whose adapter produced the rollouts (trained into step+1)."""

    step: int
    rewards: list[float]
    rollout_s: float
    train_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # means of the trajectories' metrics
    train_metrics: dict[str, float] = field(default_factory=dict)  # the step's TrainResult metrics
    solved: bool = False  # every rollout scored the task's ceiling: not trained, the run ends here
    # Pipelined loop: per group, how many steps the policy that sampled it is behind the one it trains.
    steps_behind: list[int] = field(default_factory=list)

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards)

    def row(self) -> dict[str, Any]:
        """The step's line of rewards.json."""
        return {
            "step": self.step,
            "mean_reward": self.mean_reward,
            "std_reward": statistics.pstdev(self.rewards),
            "min_reward": min(self.rewards),
            "max_reward": max(self.rewards),
            "trajectories": len(self.rewards),
            "rollout_s": self.rollout_s,
            "train_s": self.train_s,
            "metrics": self.metrics,
        }


async def complete(
    model: Any, messages: list[Any], *, max_tokens: int, temperature: float, seed: int, **options: Any
) -> Any:
    """One chat completion on the model's current step with what training needs: logprobs, and the ids
    the server sampled, so the trainer trains on exactly them (the gateway asks for them on its own;
    asking here too keeps a rollout without the gateway exact). `options` go to the request as given,
    `extra_body` merged with ours."""
    extra_body = {"return_token_ids": True, **options.pop("extra_body", {})}
    return await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
        seed=seed,
        extra_body=extra_body,
        **options,
    )


def rollout_seed(seed: int, step: int, group: int, index: int) -> int:
    """The sampling seed of one rollout: a function of its position only, so a run is reproducible."""
    return ((seed * 1000 + step) * 100 + group) * 100 + index
