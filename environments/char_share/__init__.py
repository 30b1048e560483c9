"""Character-share task: the reward is the mean, over an answer's tokens, of the share of each token's
characters that belong to a character class (by default the vowels); 1.0 for answers of all-vowel tokens.
Any model can raise it by shifting probability to tokens rich in that class, so even a tiny random model
learns it in a couple of dozen steps: a fast end-to-end check of rollouts, training and weight sync.
scripts/demo.py trains it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import art_sglang as art
from environments.environment import complete

PROMPTS = ("Write a short sentence.", "Say something.", "Describe the sea.", "Name a colour.")
# At most this many steps in a default run: the tiny model at its learning rate (environments/common.py)
# climbed from 0.3 to the ceiling in 16-22 steps on seeds 0-4 (seed 0: 20), and a run stops once every
# rollout of a step scores it.
STEPS = 22


@dataclass(frozen=True)
class CharShareTask:
    """Which characters are rewarded, and how rollouts are sampled."""

    name: str = "char-share"
    chars: str = "aeiou"
    prompts: tuple[str, ...] = PROMPTS
    max_tokens: int = 12
    temperature: float = 1.0
    ceiling: float = 1.0  # the best reward: answers of all-vowel tokens
    tiny_model_learns: bool = True  # the only task that does (environments/common.py says so for others)

    def share(self, text: str) -> float | None:
        """Share of the non-whitespace characters of `text` in the class; None when there are none."""
        visible = [c for c in text if not c.isspace()]
        if not visible:
            return None
        return sum(c.lower() in self.chars for c in visible) / len(visible)

    def reward(self, tokens: Sequence[str]) -> float:
        """Mean share over the answer's tokens that show characters; 0 for an empty answer.

        Per token, not per character: counted per character, a long token of mostly vowels (" eve",
        "queue") raises the share more than a short all-vowel one ("a", "io") while the share is low, so
        it wins the race, the policy becomes certain of it, and the run ends at its share (2/3, 0.8)
        with no signal left. Per token the all-vowel tokens always gain the most, and they are the
        ceiling (1.0)."""
        shares = [s for s in map(self.share, tokens) if s is not None]
        return sum(shares) / len(shares) if shares else 0.0

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
        reward = self.reward(answer_tokens(choice))
        return art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=reward,
            metrics={"share": reward},
            metadata={"seed": seed},
        )


def answer_tokens(choice: Any) -> list[str]:
    """The texts of the tokens that make up the answer's content (the end-of-turn token left out)."""
    content = choice.message.content or ""
    tokens: list[str] = []
    length = 0
    for entry in choice.logprobs.content:
        if length >= len(content):
            break
        tokens.append(entry.token)
        length += len(entry.token)
    return tokens
