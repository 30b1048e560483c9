"""A tool-using agent: the model gets a `calculator` tool through the OpenAI `tools=[...]` API, calls it
(the server parses the model's tool-call markup into `message.tool_calls`; on SGLang that needs
`--tool-call-parser` for the model's format), reads the result from a `tool` message and answers.

Reward: 0.5 for a well-formed calculator call (arguments parse and the expression evaluates) + 0.5 for
the exact final answer (`Answer: <integer>`). Trajectories carry the tool schema and the tool messages,
so training sees the conversation as the chat template renders it with tools.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import art_sglang as art
from environments.arithmetic import final_answer
from environments.environment import complete

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (integers, + - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}
SYSTEM_PROMPT = (
    "You can use the calculator tool. Use it to compute the result, then reply with 'Answer: <integer>'."
)
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / and parentheses; ValueError otherwise."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError(f"not an arithmetic expression: {ast.dump(node)[:60]}")

    try:
        return walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, TypeError) as exc:
        raise ValueError(str(exc)) from exc


def call_tool(name: str, arguments: str) -> tuple[str, bool]:
    """Run one tool call: (the tool message's content, whether the call was well-formed)."""
    if name != CALCULATOR["function"]["name"]:
        return f"error: unknown tool {name!r}", False
    try:
        expression = json.loads(arguments)["expression"]
        value = evaluate(str(expression))
    except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        return f"error: {exc}", False
    return (str(int(value)) if float(value).is_integer() else f"{value:.6g}"), True


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def make_problem(rng: random.Random) -> Problem:
    """An expression of two- and three-digit numbers, awkward to compute without a tool."""
    a, b, c = rng.randint(12, 999), rng.randint(12, 99), rng.randint(100, 9999)
    shape = rng.choice(("{a} * {b} + {c}", "{a} * {b} - {c}", "({a} + {c}) * {b}"))
    expression = shape.format(a=a, b=b, c=c)
    return Problem(f"What is {expression}?", int(evaluate(expression)))


@dataclass(frozen=True)
class CalculatorTask:
    """Up to `max_turns` model turns per rollout (tool calls, then the answer). `first_tool_choice`
    "required" makes the server start the first turn with a tool call (a model that has not learned the
    tool-call format yet gets tool results to learn from once its arguments are JSON)."""

    name: str = "calculator"
    max_tokens: int = 128
    max_turns: int = 3
    temperature: float = 1.0
    first_tool_choice: Literal["auto", "required"] = "auto"

    def scenarios(self, step: int, count: int, seed: int) -> Sequence[Problem]:
        rng = random.Random(seed * 1_000_003 + step)
        return [make_problem(rng) for _ in range(count)]

    async def rollout(self, model: Any, problem: Problem, seed: int) -> art.Trajectory:
        trajectory = art.Trajectory(
            messages_and_choices=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": problem.question},
            ],
            tools=[CALCULATOR],
            metadata={"seed": seed, "answer": problem.answer},
        )
        calls = good_calls = 0
        for turn in range(self.max_turns):
            response = await complete(
                model,
                trajectory.messages(),
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=seed * 10 + turn,
                tools=trajectory.tools,
                tool_choice=self.first_tool_choice if turn == 0 else "auto",
            )
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            tool_calls = choice.message.tool_calls or []
            if not tool_calls:
                break
            for call in tool_calls:
                content, well_formed = call_tool(call.function.name, call.function.arguments)
                calls += 1
                good_calls += well_formed
                trajectory.messages_and_choices.append(
                    {"role": "tool", "tool_call_id": call.id, "content": content}
                )
        final = choice.message.content or ""
        correct = not choice.message.tool_calls and final_answer(final) == problem.answer
        trajectory.reward = 0.5 * (good_calls > 0) + 0.5 * correct
        trajectory.metrics.update(
            tool_calls=calls, good_tool_calls=good_calls, correct=float(correct), turns=turn + 1
        )
        return trajectory
