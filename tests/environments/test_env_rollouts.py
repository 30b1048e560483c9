"""Each environment's rollout and reward on the tiny model through the reference engine and the backend's
gateway (one backend for the module): arithmetic answers are scored by the task's own reward, tic-tac-toe
games last several turns whose prompts hit the server's prefix cache and train as one multi-turn step
(also under an action mask), and calculator requests carry the tool schema."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import pytest_asyncio

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # environments/ is a top-level folder of the checkout

import art_sglang as art  # noqa: E402
from art_sglang.config import TrainerConfig  # noqa: E402
from environments.arithmetic import ArithmeticTask  # noqa: E402
from environments.calculator import CALCULATOR, CalculatorTask  # noqa: E402
from environments.common import TINY_LEARNING_RATE, TINY_TARGETS  # noqa: E402
from environments.tictactoe import OUTCOME_SCORE, TicTacToeTask, cell_tokens  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    path = tmp_path_factory.mktemp("envs") / ".art"
    backend = art.SGLangBackend(
        path=str(path), engine="reference", trainer_config=TrainerConfig(target_modules=TINY_TARGETS)
    )
    model = art.TrainableModel(name="envs", project="tests", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


async def test_arithmetic_rollouts_are_scored_by_exact_match(served) -> None:
    _, model = served
    task = ArithmeticTask(max_tokens=12)
    (problem,) = task.scenarios(0, 1, seed=0)
    trajectories = [await task.rollout(model, problem, seed) for seed in range(3)]
    for trajectory in trajectories:
        choice = trajectory.messages_and_choices[-1]
        assert choice.logprobs is not None and trajectory.metadata["answer"] == problem.answer
        assert trajectory.reward == task.reward(choice.message.content or "", problem)
        assert trajectory.metrics["correct"] == trajectory.reward


async def test_tictactoe_games_reuse_the_prefix_cache_and_train_as_multi_turn(served) -> None:
    backend, model = served
    task = TicTacToeTask(max_tokens=16)
    games = [
        await task.play(model, opponent_seed, seed) for opponent_seed, seed in ((1, 10), (2, 20), (3, 30))
    ]
    for game in games:
        trajectory, turns = game.trajectory, game.turns
        choices = [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]
        # Three marks in a row take three moves of one side, and X (the model) always moves first.
        assert len(turns) == len(choices) == trajectory.metrics["turns"] >= 3
        legal = trajectory.metrics["legal_moves"]
        assert trajectory.reward == pytest.approx(0.8 * OUTCOME_SCORE[game.outcome] + 0.2 * legal)
        # Each later prompt extends the previous prompt and answer: the server serves at least the whole
        # earlier prompt from its cache.
        for before, after in itertools.pairwise(turns):
            assert after.prompt_tokens > before.prompt_tokens
            assert before.prompt_tokens <= after.cached_tokens < after.prompt_tokens
        assert 0 < trajectory.metrics["cached_share"] < 1
    groups = [art.TrajectoryGroup([g.trajectory for g in games])]
    assert len({t.reward for t in groups[0].trajectories}) > 1  # a signal to train on
    result = await backend.train(model, groups, learning_rate=TINY_LEARNING_RATE)
    assert result.step == 1 and result.metrics["tokenize/exact_ids"] == sum(len(g.turns) for g in games)


async def test_tictactoe_with_an_action_mask_plays_only_free_cells_and_trains_under_the_mask(served) -> None:
    backend, model = served
    task = TicTacToeTask(name="masked", max_tokens=1, action_mask=True)
    games = [
        await task.play(model, opponent_seed, seed) for opponent_seed, seed in ((4, 40), (5, 50), (6, 60))
    ]
    digits = cell_tokens(model.base_model)
    for game in games:
        assert game.trajectory.metrics["legal_moves"] == 1.0
        for choice in (i for i in game.trajectory.messages_and_choices if not isinstance(i, dict)):
            assert len(choice.token_ids) == 1 and set(choice.token_ids) <= set(digits)
            assert set(choice.art_constraint["allowed_token_ids"]) <= set(digits)
    groups = [art.TrajectoryGroup([g.trajectory for g in games])]
    assert len({t.reward for t in groups[0].trajectories}) > 1
    result = await backend.train(model, groups, learning_rate=TINY_LEARNING_RATE)
    assert result.metrics["tokenize/constrained"] == sum(len(g.turns) for g in games)


async def test_calculator_requests_carry_the_tool(served) -> None:
    _, model = served
    task = CalculatorTask(max_tokens=12)
    (problem,) = task.scenarios(0, 1, seed=0)
    trajectory = await task.rollout(model, problem, seed=1)
    assert trajectory.tools == [CALCULATOR]
    choice = trajectory.messages_and_choices[2]
    assert choice.logprobs is not None
    calls = trajectory.metrics["tool_calls"]
    assert (
        trajectory.reward
        == 0.5 * (trajectory.metrics["good_tool_calls"] > 0) + 0.5 * trajectory.metrics["correct"]
    )
    assert len(trajectory.messages()) == 3 + calls + (trajectory.metrics["turns"] - 1)
