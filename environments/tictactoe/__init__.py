"""Tic-tac-toe against a scripted opponent: a multi-turn game in one conversation.

The model plays X and moves first, answering with the number of a free cell. Every turn re-sends the
whole conversation, so each prompt extends the previous prompt and answer: on SGLang the radix cache
serves that shared prefix, and each turn's `usage.prompt_tokens_details.cached_tokens` (reported with
`--enable-cache-report`, on by default in `SGLangConfig`) shows it; `play()` records it per turn. A move
that is not a free cell loses the turn, so a game always lasts several turns, even for a random model.

Reward: 0.8 x outcome (win 1, draw 0.5, loss 0) + 0.2 x the share of the model's moves that were legal.

With `action_mask=True` each turn is a constrained rollout of one token: the request's `allowed_token_ids`
are the digits of the free cells, so every move is legal and the model learns only which free cell to take
(the end-of-turn token is left out: allowed first, it would end the turn without a move). The trainer scores those tokens under the same mask (art_sglang's constraints; an
SGLangBackend feature, not ART's LocalBackend's).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import art_sglang as art
from environments.environment import complete

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
SYSTEM_PROMPT = (
    "We play tic-tac-toe. You are X and I am O. Cells are numbered 1 to 9, left to right, top to bottom. "
    "On your turn, answer with the number of one free cell and nothing else."
)
OUTCOME_SCORE = {"win": 1.0, "draw": 0.5, "loss": 0.0}
_DIGIT = re.compile(r"[1-9]")


def render(cells: list[str]) -> str:
    """The board with free cells shown by their number."""
    shown = [mark if mark != " " else str(i + 1) for i, mark in enumerate(cells)]
    return "\n".join(" ".join(shown[row : row + 3]) for row in (0, 3, 6))


def winner(cells: list[str]) -> str | None:
    for a, b, c in LINES:
        if cells[a] != " " and cells[a] == cells[b] == cells[c]:
            return cells[a]
    return None


def parse_move(text: str) -> int | None:
    """The cell index (0-8) of the first digit 1-9 in `text`, or None."""
    found = _DIGIT.search(text)
    return int(found.group()) - 1 if found else None


def opponent_move(cells: list[str], rng: random.Random, randomness: float) -> int:
    """Win if O can, else block X, else the centre, else a random free cell; with probability `randomness`
    a random free cell instead, so the game can be won."""
    free = [i for i, mark in enumerate(cells) if mark == " "]
    if rng.random() < randomness:
        return rng.choice(free)
    for mark in ("O", "X"):
        for line in LINES:
            marks = [cells[i] for i in line]
            if marks.count(mark) == 2 and marks.count(" ") == 1:
                return line[marks.index(" ")]
    return 4 if 4 in free else rng.choice(free)


@dataclass(frozen=True)
class TurnUsage:
    """Prompt tokens of one model turn and how many of them the server served from its prefix cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Game:
    trajectory: art.Trajectory
    outcome: str  # "win", "draw" or "loss", from the model's side
    turns: list[TurnUsage] = field(default_factory=list)


@dataclass(frozen=True)
class TicTacToeTask:
    """Games against the scripted opponent; `opponent_randomness` is its share of random moves."""

    name: str = "tic-tac-toe"
    max_tokens: int = 8
    temperature: float = 1.0
    opponent_randomness: float = 0.3
    action_mask: bool = False  # sample one token, a free cell's digit (use with max_tokens=1)

    def scenarios(self, step: int, count: int, seed: int) -> Sequence[int]:
        """One opponent seed per group: the opponent of a group is the same game after game."""
        return [(seed * 1_000_003 + step) * 100 + g for g in range(count)]

    async def rollout(self, model: Any, opponent_seed: int, seed: int) -> art.Trajectory:
        return (await self.play(model, opponent_seed, seed)).trajectory

    async def play(self, model: Any, opponent_seed: int, seed: int) -> Game:
        """One game, the model moving first; each model turn is one chat completion on the whole game."""
        rng = random.Random(opponent_seed)
        cells = [" "] * 9
        trajectory = art.Trajectory(
            messages_and_choices=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{render(cells)}\nYour move."},
            ],
            metadata={"seed": seed, "opponent_seed": opponent_seed},
        )
        turns: list[TurnUsage] = []
        legal = 0
        while True:
            response = await complete(
                model,
                trajectory.messages(),
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=seed * 10 + len(turns),
                **(self._mask(model, cells) if self.action_mask else {}),
            )
            turns.append(_usage(response))
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            move = parse_move(choice.message.content or "")
            if move is not None and cells[move] == " ":
                cells[move] = "X"
                legal += 1
                note = f"You played {move + 1}."
            else:
                note = "That is not a free cell: you lose this turn."
            outcome = _outcome(cells)
            if outcome is None:
                reply = opponent_move(cells, rng, self.opponent_randomness)
                cells[reply] = "O"
                note += f" I played {reply + 1}."
                outcome = _outcome(cells)
            if outcome is not None:
                break
            trajectory.messages_and_choices.append(
                {"role": "user", "content": f"{note}\n{render(cells)}\nYour move."}
            )
        trajectory.reward = 0.8 * OUTCOME_SCORE[outcome] + 0.2 * legal / len(turns)
        trajectory.metrics.update(
            win=float(outcome == "win"),
            draw=float(outcome == "draw"),
            legal_moves=legal / len(turns),
            turns=len(turns),
        )
        later = [t for t in turns[1:] if t.prompt_tokens]
        if later:  # the prefix cache can only serve turns after the first
            trajectory.metrics["cached_share"] = sum(t.cached_tokens for t in later) / sum(
                t.prompt_tokens for t in later
            )
        return Game(trajectory, outcome, turns)

    @staticmethod
    def _mask(model: Any, cells: list[str]) -> dict[str, Any]:
        """The request options that allow only a free cell's digit."""
        digits = cell_tokens(model.base_model)
        return {
            "extra_body": {"allowed_token_ids": [digits[i] for i, mark in enumerate(cells) if mark == " "]}
        }


@functools.cache
def cell_tokens(base_model: str) -> list[int]:
    """The token ids of the digits 1-9 in the model's tokenizer (one token each)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    digits = [tokenizer.encode(str(d), add_special_tokens=False) for d in range(1, 10)]
    if any(len(ids) != 1 for ids in digits):
        raise ValueError(
            f"{base_model}'s tokenizer does not spell each digit 1-9 as one token: no action mask"
        )
    return [ids[0] for ids in digits]


def _outcome(cells: list[str]) -> str | None:
    mark = winner(cells)
    if mark is not None:
        return "win" if mark == "X" else "loss"
    return "draw" if " " not in cells else None


def _usage(response: Any) -> TurnUsage:
    usage = response.usage
    if usage is None:
        return TurnUsage(0, 0)
    details = usage.prompt_tokens_details
    # SGLang (like the reference engine) leaves the details out when nothing was cached.
    cached = (details.cached_tokens or 0) if details is not None else 0
    return TurnUsage(usage.prompt_tokens, cached)
