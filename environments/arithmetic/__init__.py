"""Arithmetic word problems with verifiable answers: problems are generated locally from a seed (no data
set to download), the model reasons and ends with `Answer: <integer>`, and the reward is 1 for an exact
match of that integer, else 0. A task a real instruct model (Qwen2.5-0.5B and up) learns; the tiny random
model only exercises the plumbing.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import art_sglang as art
from environments.environment import complete

NAMES = ("Ana", "Bo", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivo", "June")
ITEMS = ("apples", "stamps", "marbles", "books", "coins", "shells", "stickers", "pencils")
SYSTEM_PROMPT = (
    "Solve the word problem. Think briefly, then give the final answer on the last line as "
    "'Answer: <integer>'."
)
_ANSWER = re.compile(r"answer\s*:\s*\$?(-?[\d,]+)", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def make_problem(rng: random.Random, *, operations: int = 3, max_value: int = 50) -> Problem:
    """A story of `operations` events on a count of items; the count never goes below zero."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, max_value)
    sentences = [f"{name} has {count} {item}."]
    for _ in range(operations):
        kind = rng.choice(("gain", "lose", "packs", "double") if count > 1 else ("gain", "packs"))
        if kind == "gain":
            k = rng.randint(1, max_value)
            sentences.append(f"Then {name} finds {k} more.")
            count += k
        elif kind == "lose":
            k = rng.randint(1, count - 1)
            sentences.append(f"Then {name} gives {k} of them away.")
            count -= k
        elif kind == "packs":
            packs, size = rng.randint(2, 5), rng.randint(2, 12)
            sentences.append(f"Then {name} buys {packs} packs of {size} {item} each.")
            count += packs * size
        else:
            sentences.append(f"Then the number of {item} {name} has doubles.")
            count *= 2
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), count)


def final_answer(text: str) -> int | None:
    """The integer of the last `Answer: N` in `text` (commas allowed as digit separators), or None."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class ArithmeticTask:
    """Word problems of `operations` steps on numbers up to `max_value`."""

    name: str = "arithmetic"
    operations: int = 3
    max_value: int = 50
    max_tokens: int = 256
    temperature: float = 1.0

    def scenarios(self, step: int, count: int, seed: int) -> Sequence[Problem]:
        """`count` problems, different for every (seed, step)."""
        rng = random.Random(seed * 1_000_003 + step)
        return [make_problem(rng, operations=self.operations, max_value=self.max_value) for _ in range(count)]

    def reward(self, text: str, problem: Problem) -> float:
        """1.0 when the final answer equals the problem's, else 0.0."""
        return float(final_answer(text) == problem.answer)

    async def rollout(self, model: Any, problem: Problem, seed: int) -> art.Trajectory:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
        ]
        response = await complete(
            model, messages, max_tokens=self.max_tokens, temperature=self.temperature, seed=seed
        )
        choice = response.choices[0]
        text = choice.message.content or ""
        reward = self.reward(text, problem)
        return art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=reward,
            metrics={"correct": reward, "answered": float(final_answer(text) is not None)},
            metadata={"seed": seed, "answer": problem.answer},
        )
