"""The trainer: trajectory groups → tokens → GRPO-style loss → LoRA update, in a worker subprocess.

The names here import no torch; the worker side (trainer, loss, model loading) loads it when used.
"""

from __future__ import annotations

from .options import StepOutcome, TrainOptions
from .process import TrainerProcess
from .validation import groups_to_wire, validate_groups

__all__ = ["StepOutcome", "TrainOptions", "TrainerProcess", "groups_to_wire", "validate_groups"]
