"""Constrained Choices in the trainer: the logprobs of their sampled tokens are computed under the
constraint they carry (masked log-softmax, added bias, a grammar's per-token mask), and a constraint the
trainer cannot reproduce is refused naming it unless the user trains with train_unconstrained=True."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from openai.types.chat.chat_completion import Choice
from training_helpers import sampled

from art_sglang import grammars
from art_sglang.chat_format import template_tools
from art_sglang.config import TrainerConfig
from art_sglang.constraints import CONSTRAINT_FIELD, Grammar, SamplingConstraint, carried
from art_sglang.errors import TrainingInputError
from art_sglang.training.loss import constrain_rows
from art_sglang.training.options import TrainOptions
from art_sglang.training.tokenize import ChatTokenizer, TokenizeStats
from art_sglang.training.trainer import Trainer
from art_sglang.training.validation import groups_to_wire, validate_groups
from art_sglang.trajectories import Trajectory, TrajectoryGroup, coerce_groups


def constrained_choice(
    tokenizer: Any, ids: list[int], logprobs: list[float], constraint: dict | None, finish: str = "length"
) -> Choice:
    return sampled(tokenizer, ids, logprobs, finish, **{CONSTRAINT_FIELD: constraint})


def wire_groups(*choices: Choice, rewards: tuple[float, ...] = (1.0, 0.0)) -> list[dict[str, Any]]:
    trajectories = [
        Trajectory(messages_and_choices=[{"role": "user", "content": f"move {i}"}, c], reward=r)
        for i, (c, r) in enumerate(zip(choices, rewards, strict=True))
    ]
    return groups_to_wire([TrajectoryGroup(trajectories)])


@torch.no_grad()
def masked_logprobs(
    model: Any, tokenizer: Any, prompt: str, ids: list[int], allowed: list[int]
) -> list[float]:
    """Each id's logprob under the allowed set, straight from the model: log-softmax over the allowed logits."""
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    logits = model(input_ids=torch.tensor([head + ids])).logits[0, len(head) - 1 : -1]
    return [float(logits[i, allowed].log_softmax(-1)[allowed.index(t)]) for i, t in enumerate(ids)]


def test_constrain_rows_masks_biases_and_applies_grammar_steps() -> None:
    rows = torch.randn(3, 70)
    allowed = SamplingConstraint(allowed_token_ids=(2, 5, 64), logit_bias=((5, 1.5),))
    bitmask = torch.zeros(3, dtype=torch.int32)
    bitmask[0] = 1 << 7
    bitmask[2] = 1 << 1  # token 65
    step = grammars.GrammarStep(bitmask, SamplingConstraint(logit_bias=((7, -2.0),)))
    out = constrain_rows(rows, [allowed, None, step]).log_softmax(-1)
    expected = rows[0, [2, 5, 64]] + torch.tensor([0.0, 1.5, 0.0])
    assert out[0, [2, 5, 64]].tolist() == pytest.approx(expected.log_softmax(-1).tolist(), abs=1e-6)
    assert math.isinf(out[0, 3]) and out[1].tolist() == pytest.approx(
        rows[1].log_softmax(-1).tolist(), abs=1e-6
    )
    assert out[2, [7, 65]].tolist() == pytest.approx(
        (rows[2, [7, 65]] + torch.tensor([-2.0, 0.0])).log_softmax(-1).tolist()
    )
    with pytest.raises(TrainingInputError, match="names token 99, outside the model's vocabulary"):
        constrain_rows(rows, [SamplingConstraint(allowed_token_ids=(1, 99))])


def test_the_trainer_scores_constrained_tokens_under_their_constraint(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path / "run", TrainerConfig())
    trainer.resume_or_init()
    allowed = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(1, 10)]
    moves = [allowed[:3], allowed[4:5]]  # two sequences of different lengths in one micro-batch
    with trainer.model.disable_adapter():
        old = [
            masked_logprobs(trainer.model, tokenizer, f"move {i}", ids, allowed)
            for i, ids in enumerate(moves)
        ]
    constraint = {"allowed_token_ids": allowed}
    choices = [
        constrained_choice(tokenizer, ids, lps, constraint) for ids, lps in zip(moves, old, strict=True)
    ]
    outcome = trainer.train(wire_groups(*choices), TrainOptions(learning_rate=1e-4), lambda _: None)
    # The policy before its first update is the base model, which gave the old logprobs: ratio 1.
    assert outcome.metrics["tokenize/constrained"] == 2.0
    assert outcome.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    plain = [constrained_choice(tokenizer, ids, lps, None) for ids, lps in zip(moves, old, strict=True)]
    unconstrained = trainer.train(wire_groups(*plain), TrainOptions(learning_rate=1e-4), lambda _: None)
    assert unconstrained.metrics["ratio_mean"] < 0.5  # what scoring them unconstrained did


@pytest.mark.parametrize(
    ("choice_extra", "message"),
    [
        ({"token_ids": None}, "has no token_ids"),
        (
            {CONSTRAINT_FIELD: {"allowed_token_ids": [1, 2]}},
            "token 5 of its token_ids is not in the allowed_token_ids",
        ),
    ],
)
def test_a_constrained_choice_that_cannot_be_trained_as_sampled_is_refused(
    tokenizer: Any, choice_extra: dict, message: str
) -> None:
    choice = constrained_choice(tokenizer, [5, 6], [-1.0, -1.0], {"allowed_token_ids": [5, 6]})
    choice = choice.model_copy(update=choice_extra)
    with pytest.raises(TrainingInputError, match=f"group 0, trajectory 0, choice 0: .*{message}"):
        validate_groups(wire_groups(choice, rewards=(1.0,)), allow_training_without_logprobs=False)


def test_a_grammar_without_xgrammar_is_refused_naming_it_unless_trained_unconstrained(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("validation", "tokenize"):
        monkeypatch.setattr(f"art_sglang.training.{module}.grammars_available", lambda: False)
    constraint = SamplingConstraint(grammar=Grammar(kind="regex", source="[0-9]+"), logit_bias=((5, 2.0),))
    choice = constrained_choice(tokenizer, [5, 6], [-1.0, -1.0], constraint.model_dump(mode="json"))
    groups = wire_groups(choice, rewards=(1.0,))
    with pytest.raises(TrainingInputError, match=r"choice 0: a constrained Choice \(logit_bias on 1 tokens, a regex "
                       r"grammar\).*regex grammar.*xgrammar.*train_unconstrained=True"):  # fmt: skip
        validate_groups(groups, allow_training_without_logprobs=False)
    validate_groups(groups, allow_training_without_logprobs=False, train_unconstrained=True)
    # Trained without the grammar, the rest of the constraint still applies.
    [sequence] = ChatTokenizer(tokenizer).tokenize_trajectory(
        groups[0]["trajectories"][0], group=0, index=0, stats=TokenizeStats()
    )
    sampled = [c for c, m in zip(sequence.constraints or [], sequence.sampled_mask, strict=True) if m]
    assert sampled == [SamplingConstraint(logit_bias=((5, 2.0),))] * 2


def test_the_constraint_survives_the_json_round_trip_of_arts_objects(tokenizer: Any) -> None:
    # ART's (openpipe-art) groups reach train() through their JSON form (trajectories.coerce_groups).
    choice = constrained_choice(tokenizer, [5, 6], [-1.0, -1.0], {"allowed_token_ids": [5, 6, 7]})
    group = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice])])
    [again] = coerce_groups([_Foreign(group.model_dump(mode="json"))])
    [wire] = groups_to_wire([again])
    carried_back = carried(wire["trajectories"][0]["messages_and_choices"][1], "choice")
    assert carried_back == SamplingConstraint(allowed_token_ids=(5, 6, 7))


class _Foreign:
    """Stands in for another library's group: what coerce_groups reads is `trajectories` and `model_dump`."""

    def __init__(self, dumped: dict[str, Any]) -> None:
        self._dumped = dumped
        self.trajectories = dumped["trajectories"]

    def model_dump(self) -> dict[str, Any]:
        return self._dumped


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }


TOOLS = [_tool("add"), _tool("mul")]


def tool_trajectory(*choices: Choice) -> list[dict[str, Any]]:
    items: list[Any] = [{"role": "user", "content": "add or mul"}]
    for choice in choices:
        items += [choice, {"role": "user", "content": "again"}]
    trajectory = Trajectory(messages_and_choices=items[:-1], tools=TOOLS, reward=1.0)
    return groups_to_wire([TrajectoryGroup([trajectory])])


def test_a_history_is_rendered_with_the_tools_its_choices_were_prompted_with(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer)

    def prompt_ids(groups: list[dict[str, Any]]) -> list[int]:
        [sequence] = chat.tokenize_trajectory(
            groups[0]["trajectories"][0], group=0, index=0, stats=TokenizeStats()
        )
        return sequence.input_ids[: sequence.sampled_mask.index(1)]

    def rendered(tools: list[Any] | None) -> list[int]:
        messages = [{"role": "user", "content": "add or mul"}]
        return tokenizer.apply_chat_template(
            messages,
            tools=template_tools(tools),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    plain = sampled(tokenizer, [5, 6], [-1.0, -1.0], "length")
    assert prompt_ids(tool_trajectory(plain)) == rendered(TOOLS) != rendered(None)
    for shown in ([], [TOOLS[1]]):  # "none", a named tool
        choice = sampled(tokenizer, [5, 6], [-1.0, -1.0], "length", art_template_tools=shown)
        assert prompt_ids(tool_trajectory(choice)) == rendered(shown or None)


def test_a_trajectory_sampled_with_different_tools_in_its_prompts_is_refused_naming_it(
    tokenizer: Any,
) -> None:
    auto = sampled(tokenizer, [5, 6], [-1.0, -1.0], "length")
    none = sampled(tokenizer, [7], [-1.0], "length", art_template_tools=[])
    groups = tool_trajectory(auto, none)
    with pytest.raises(
        TrainingInputError,
        match=r"group 0, trajectory 0: its Choices were sampled with different tools in their prompts "
        r"\(tools add, mul; no tools.*train_unconstrained=True",
    ):
        validate_groups(groups, allow_training_without_logprobs=False)
    validate_groups(groups, allow_training_without_logprobs=False, train_unconstrained=True)
    validate_groups(tool_trajectory(none, none), allow_training_without_logprobs=False)


def test_a_forced_tool_call_without_xgrammar_is_refused_naming_its_structural_tag(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from art_sglang.tool_choice import tool_use

    monkeypatch.setattr("art_sglang.training.validation.grammars_available", lambda: False)
    constraint = SamplingConstraint(grammar=tool_use(TOOLS, "required", True, "hermes").constraint)
    choice = constrained_choice(tokenizer, [5, 6], [-1.0, -1.0], constraint.model_dump(mode="json"))
    with pytest.raises(TrainingInputError, match=r"choice 0: .*a structural_tag grammar.*xgrammar"):
        validate_groups(wire_groups(choice, rewards=(1.0,)), allow_training_without_logprobs=False)
