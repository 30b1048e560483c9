"""`TrainOptions`: the per-call knobs of one training step (ART 0.5.x names), and `StepOutcome`, what a
step reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainOptions(BaseModel):
    """Options of one `train()` call. The model shape and memory knobs live in `TrainerConfig`."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate of this step.")
    loss_fn: Literal["ppo"] = Field("ppo", description="Clipped importance-weighted policy gradient.")
    epsilon: float = Field(0.2, gt=0, description="Lower clip: ratios below 1 - epsilon are clipped.")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip: ratios above 1 + epsilon_high are clipped; None = epsilon."
    )
    scale_rewards: bool = Field(True, description="Divide advantages by the group's reward std.")
    kl_penalty_coef: float = Field(
        0.0, ge=0, description="Weight of the KL penalty to the base model (adapter disabled); 0 = off."
    )
    max_grad_norm: float | None = Field(
        None, gt=0, description="Gradient clipping for this step; None = TrainerConfig.max_grad_norm."
    )
    allow_training_without_logprobs: bool = Field(
        False,
        description="Train choices that carry no sampler logprobs (the trainer's own logprobs stand in, "
        "so their importance ratio is 1).",
    )
    save_checkpoint: bool = Field(True, description="Write the new adapter as checkpoint <step>.")

    @model_validator(mode="after")
    def _default_epsilon_high(self) -> TrainOptions:
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        return self


@dataclass
class StepOutcome:
    """The result of one `train()` call. `trained=False` means no optimizer step was taken (the step
    number is unchanged) and `reason` says why; the metrics still count what was seen and skipped."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    trained: bool = True
    reason: str | None = None
