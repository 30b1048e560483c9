"""Character-share task: the reward is the share of an answer's characters that belong to a character
class (by default the vowels). Any model can raise it by shifting probability to tokens rich in that
class, so even a tiny random model learns it within a few steps: a fast end-to-end check of rollouts,
training and weight sync. scripts/demo.py trains it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import art_sglang as art
from environments.common import complete

PROMPTS = ("Write a short sentence.", "Say something.", "Describe the sea.", "Name a colour.")


@dataclass(frozen=True)
class CharShareTask:
    """Which characters are rewarded, and how rollouts are sampled."""

    name: str = "char-share"
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

    def scenarios(self, step: int, count: int, seed: int) -> Sequence[str]:
        """The prompts, in turn (the same every step)."""
        return [self.prompts[g % len(self.prompts)] for g in range(count)]

    async def rollout(self, model: Any, prompt: str, seed: int) -> art.Trajectory:
        """One chat completion on the model's current step, scored by the task."""
        messages = [{"role": "user", "content": prompt}]
        response = await complete(
            model, messages, max_tokens=self.max_tokens, temperature=self.temperature, seed=seed
        )
        choice = response.choices[0]
        reward = self.reward(choice.message.content or "")
        return art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=reward,
            metrics={"share": reward},
            metadata={"seed": seed},
        )
