"""Prefix-cache hits of a multi-turn environment through the backend: tic-tac-toe games
(environments/tictactoe) on `model@0`, one training step on them, the same games on `model@1`. Every
turn re-sends the whole game, so turn k's prompt extends turn k-1's prompt and answer; the table shows,
per turn, how much of the prompt the server reported as cached (`usage.prompt_tokens_details`, with
`--enable-cache-report`).

    python scripts/bench_multiturn.py --model /root/models/qwen2.5-1.5b-shape \
        --sampling-backend pytorch --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ from a source checkout
from bench_common import add_server_args, environment, markdown_table, server_config, write_results

import art_sglang as art
from art_sglang.config import TrainerConfig
from environments.tictactoe import Game, TicTacToeTask


def per_turn(games: list[Game]) -> list[dict[str, Any]]:
    """For each turn number: games that reached it, mean prompt and cached tokens, and the hit rate
    (cached / prompt tokens over those games)."""
    rows = []
    for turn in range(max(len(g.turns) for g in games)):
        usages = [g.turns[turn] for g in games if len(g.turns) > turn]
        prompt = sum(u.prompt_tokens for u in usages)
        cached = sum(u.cached_tokens for u in usages)
        rows.append(
            {
                "turn": turn + 1,
                "games": len(usages),
                "prompt_tokens_mean": prompt / len(usages),
                "cached_tokens_mean": cached / len(usages),
                "hit_rate": cached / prompt if prompt else 0.0,
            }
        )
    return rows


async def play_round(task: TicTacToeTask, model: Any, games: int, seed: int) -> tuple[list[Game], float]:
    started = time.perf_counter()
    played = await asyncio.gather(*(task.play(model, seed * 1000 + g, seed * 1000 + g) for g in range(games)))
    return list(played), time.perf_counter() - started


async def run(args: argparse.Namespace) -> dict[str, Any]:
    task = TicTacToeTask(max_tokens=args.max_tokens)
    model = art.TrainableModel(name="tictactoe", project="bench", base_model=args.model)
    backend = art.SGLangBackend(
        path=str(args.workdir / ".art"),
        engine=args.engine,
        sglang_config=server_config(args),
        trainer_config=TrainerConfig(lora_rank=args.lora_rank),
    )
    rounds = []
    async with backend:
        await model.register(backend)
        for round_ in range(2):
            step = await model.get_step()
            games, seconds = await play_round(task, model, args.games, seed=round_)
            rounds.append(
                {
                    "step": step,
                    "games": len(games),
                    "seconds": seconds,
                    "mean_reward": statistics.fmean(g.trajectory.reward for g in games),
                    "turns": per_turn(games),
                }
            )
            if round_ == 0:
                # Two groups, so the trainer sees reward differences within each.
                half = len(games) // 2
                groups = [
                    art.TrajectoryGroup(g.trajectory for g in part) for part in (games[:half], games[half:])
                ]
                result = await backend.train(model, groups, learning_rate=1e-5)
                rounds[-1]["train_metrics"] = {
                    k: v for k, v in result.metrics.items() if k.startswith("time/")
                }
    return {
        "benchmark": "multiturn prefix cache (tic-tac-toe through SGLangBackend)",
        "model": args.model,
        "engine": args.engine,
        "layout": backend.layout.describe(),
        "environment": environment(),
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    parser.add_argument("--games", type=int, default=32, help="games per round, played concurrently")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per model turn")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    headers = ["step", "turn", "games", "prompt tokens", "cached tokens", "hit rate"]
    rows = [
        [r["step"], t["turn"], t["games"], t["prompt_tokens_mean"], t["cached_tokens_mean"], t["hit_rate"]]
        for r in results["rounds"]
        for t in r["turns"]
    ]
    write_results(args, results, markdown_table(headers, rows))
    hit_rates = {
        f"step {r['step']}": [round(t["hit_rate"], 4) for t in r["turns"]] for r in results["rounds"]
    }
    print(json.dumps({"hit_rate_per_turn": hit_rates}))


if __name__ == "__main__":
    main()
