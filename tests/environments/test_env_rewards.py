"""The environments' scenario generators, reward functions and game/tool logic, without a server (the
calculator's tool loop runs against a scripted OpenAI client)."""

from __future__ import annotations

import json
import random
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

import art_sglang as art

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # environments/ is a top-level folder of the checkout

from environments.arithmetic import ArithmeticTask, Problem, final_answer  # noqa: E402
from environments.calculator import CALCULATOR, CalculatorTask, call_tool, evaluate  # noqa: E402
from environments.char_share import CharShareTask, answer_tokens  # noqa: E402
from environments.common import tiny_model_note, train_loop  # noqa: E402
from environments.reward_curve import write_results  # noqa: E402
from environments.tictactoe import TicTacToeTask, opponent_move, parse_move, render, winner  # noqa: E402


def test_char_share_weighs_every_token_the_same() -> None:
    task = CharShareTask()
    assert task.reward(["io", " a"]) == 1.0 and task.reward([]) == 0.0 and task.reward([" ", "\n"]) == 0.0
    # A long token of mostly vowels does not outweigh a short all-vowel one (per character it would).
    assert task.reward(["queue", "a"]) == pytest.approx((0.8 + 1.0) / 2)
    assert task.reward(["queue", "a"]) > task.reward(["queue", "queue"])
    assert task.reward([" eve", " ", "xyz"]) == pytest.approx(1 / 3)  # whitespace-only tokens do not count


def test_char_share_answer_tokens_leave_out_the_end_of_turn_token() -> None:
    completion = ChatCompletion.model_validate(
        {
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": " out io"},
                "logprobs": {"content": [
                    {"token": t, "logprob": -1.0, "bytes": None, "top_logprobs": []}
                    for t in (" out", " io", "<|im_end|>")
                ]},
            }],
        }
    )  # fmt: skip
    assert answer_tokens(completion.choices[0]) == [" out", " io"]


def test_arithmetic_problems_are_reproducible_and_their_answers_exact() -> None:
    task = ArithmeticTask()
    first, again, later = task.scenarios(0, 6, seed=1), task.scenarios(0, 6, seed=1), task.scenarios(1, 6, 1)
    assert first == again and first != later
    assert all(p.answer >= 0 and p.question.endswith("now?") for p in first)
    problem = Problem("?", 1234)
    assert task.reward("12 + 3 = 15\nAnswer: 1,234", problem) == 1.0
    assert task.reward("Answer: 1234. Actually, answer: 1233", problem) == 0.0  # the last one counts
    assert task.reward("1234", problem) == 0.0  # no 'Answer:' line
    assert final_answer("answer:  -7") == -7 and final_answer("Answer: ,") is None


def test_tictactoe_rules() -> None:
    cells = list("XX OO    ")
    assert render(cells) == "X X 3\nO O 6\n7 8 9"
    assert winner(list("XXXOO    ")) == "X" and winner(cells) is None
    rng = random.Random(0)
    assert opponent_move(cells, rng, randomness=0.0) == 5  # O wins before it blocks X at 3
    assert opponent_move(list("XX O     "), rng, randomness=0.0) == 2  # block
    assert parse_move("I take 5, then 7") == 4 and parse_move("zero 0") is None


def test_calculator_tool() -> None:
    assert call_tool("calculator", json.dumps({"expression": "(12 + 7) * 3"})) == ("57", True)
    assert call_tool("calculator", json.dumps({"expression": "7 / 2"})) == ("3.5", True)
    assert call_tool("calculator", "{not json")[1] is False
    assert call_tool("calculator", json.dumps({"expr": "1"}))[1] is False
    assert call_tool("search", "{}") == ("error: unknown tool 'search'", False)
    for unsafe in ("__import__('os')", "2 ** 10000", "1 / 0", "[1]"):
        with pytest.raises(ValueError):
            evaluate(unsafe)


class _ScriptedModel:
    """A model whose client answers with the given assistant messages in turn and records the requests."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.replies = list(messages)
        self.requests: list[dict[str, Any]] = []

    def openai_client(self) -> Any:
        return self

    @property
    def chat(self) -> Any:
        return self

    @property
    def completions(self) -> Any:
        return self

    def get_inference_name(self) -> str:
        return "scripted@0"

    async def create(self, **request: Any) -> ChatCompletion:
        self.requests.append(request)
        message = self.replies.pop(0)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return ChatCompletion.model_validate(
            {
                "id": "x", "object": "chat.completion", "created": 0, "model": "scripted@0",
                "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", **message}}],
            }
        )  # fmt: skip


def _call(expression: str) -> dict[str, Any]:
    arguments = json.dumps({"expression": expression})
    return {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}


async def test_calculator_rollout_runs_the_tool_and_scores_use_and_answer() -> None:
    task, problem = CalculatorTask(first_tool_choice="required"), Problem("What is 12 * 13 + 5?", 161)
    model = _ScriptedModel(
        [{"content": None, "tool_calls": [_call("12 * 13 + 5")]}, {"content": "Answer: 161"}]
    )
    trajectory = await task.rollout(model, problem, seed=3)
    assert trajectory.reward == 1.0 and trajectory.tools == [CALCULATOR]
    assert trajectory.metrics == {"tool_calls": 1, "good_tool_calls": 1, "correct": 1.0, "turns": 2}
    tool_message = trajectory.messages()[3]
    assert tool_message == {"role": "tool", "tool_call_id": "call_1", "content": "161"}
    # The second request carries the tool result; only the first forces a call.
    assert model.requests[1]["messages"][-1] == tool_message
    assert [r["tool_choice"] for r in model.requests] == ["required", "auto"]
    assert all(r["tools"] == [CALCULATOR] for r in model.requests)

    wrong = await task.rollout(
        _ScriptedModel([{"content": None, "tool_calls": [_call("12 *")]}, {"content": "Answer: 160"}]),
        problem,
        4,
    )
    assert wrong.reward == 0.0 and wrong.metrics["good_tool_calls"] == 0
    no_tool = await task.rollout(_ScriptedModel([{"content": "Answer: 161"}]), problem, 5)
    assert no_tool.reward == 0.5 and no_tool.metrics["turns"] == 1


@pytest.mark.parametrize("name", ["char_share", "arithmetic", "tictactoe", "calculator"])
def test_entry_point_help(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `python -m environments.<name> --help`, run in this process (a subprocess each costs seconds of imports).
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"environments.{name}", run_name="__main__")
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert "--model" in shown and "--group-size" in shown and "--engine" in shown


def test_a_bad_learning_rate_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    art_dir = tmp_path / ".art"
    monkeypatch.setattr(sys, "argv", ["char_share", "--learning-rate", "-1", "--path", str(art_dir)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("environments.char_share", run_name="__main__")
    assert exited.value.code == 2
    assert "--learning-rate -1.0: invalid train() option: learning_rate" in capsys.readouterr().err
    assert not art_dir.exists()  # not even the tiny model was built


def test_a_base_model_that_cannot_be_had_is_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["char_share", "--model", "nobody-here/no-such-model", "--path", str(tmp_path / ".art")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("environments.char_share", run_name="__main__")
    assert str(exited.value.code).startswith("error: base_model 'nobody-here/no-such-model' is not in")
    assert "hf download nobody-here/no-such-model" in str(exited.value.code)


def test_the_tiny_model_says_up_front_what_it_cannot_learn() -> None:
    assert tiny_model_note(CharShareTask()) is None
    note = tiny_model_note(TicTacToeTask())
    assert note is not None and "cannot learn tic-tac-toe" in note and "--model" in note
    assert "scripts/demo.py" in note


def test_the_reward_curve_ticks_whole_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figure_module = pytest.importorskip("matplotlib.figure")
    drawn: list[Any] = []
    monkeypatch.setattr(figure_module.Figure, "savefig", lambda figure, *_, **__: drawn.append(figure))
    rows = [
        {"step": step, "mean_reward": 0.5, "std_reward": 0.1, "min_reward": 0.3, "max_reward": 0.7}
        for step in range(20)
    ]
    write_results(tmp_path, rows, title="t")
    ticks = drawn[0].axes[0].get_xticks()
    assert len(ticks) > 2 and all(float(t).is_integer() for t in ticks), ticks


class _ScoredTask:
    """Rollouts whose rewards are given per round: without a model, to drive the loop alone."""

    name = "scored"
    max_tokens = 1
    ceiling = 1.0

    def __init__(self, rounds: list[list[float]]) -> None:
        self.rounds = rounds
        self.round = -1

    def scenarios(self, step: int, count: int, seed: int) -> list[int]:
        self.round += 1
        return list(range(count))

    async def rollout(self, model: Any, scenario: int, seed: int) -> art.Trajectory:
        reward = self.rounds[self.round][seed % 100]
        return art.Trajectory(messages_and_choices=[], reward=reward, metadata={"seed": seed})


class _CountingBackend:
    def __init__(self) -> None:
        self.trained = 0

    async def train(self, model: Any, groups: Any, **options: Any) -> Any:
        self.trained += 1
        return art.TrainResult(step=self.trained, metrics={"gradient_steps": 1.0})


class _StepModel:
    async def get_step(self) -> int:
        return 0

    async def log(self, groups: Any, split: str) -> None:
        pass


async def test_the_loop_stops_once_every_rollout_scores_the_ceiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend, printed = _CountingBackend(), []
    task = _ScoredTask([[0.5, 1.0], [1.0, 0.9], [1.0, 1.0], [0.0, 0.0]])
    reports = await train_loop(
        backend, _StepModel(), task, steps=4, groups_per_step=1, group_size=2, on_step=printed.append
    )
    # Rounds below the ceiling train, even the one whose best rollout reached it; the solved round does not,
    # and the loop ends there.
    assert backend.trained == 2 and [r.solved for r in reports] == [False, False, True]
    assert reports[-1].train_metrics == {} and printed == reports
