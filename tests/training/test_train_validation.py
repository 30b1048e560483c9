"""Bad input is refused before anything is sent to the trainer, with the group and trajectory named."""

from __future__ import annotations

import math
from typing import Any

import pytest
from training_helpers import make_choice

from art_sglang.errors import TrainingInputError
from art_sglang.training.validation import groups_to_wire, validate_groups
from art_sglang.trajectories import Trajectory, TrajectoryGroup


def good(tokenizer: Any, reward: float = 1.0) -> Trajectory:
    return Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, make_choice(tokenizer, "a 1")], reward=reward
    )


def check(groups: list[TrajectoryGroup], allow: bool = False) -> None:
    validate_groups(groups_to_wire(groups), allow_training_without_logprobs=allow)


def test_good_groups_pass(tokenizer: Any) -> None:
    check([TrajectoryGroup([good(tokenizer), good(tokenizer, 0.0)])])


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward(tokenizer: Any, reward: float) -> None:
    groups = [TrajectoryGroup([good(tokenizer)]), TrajectoryGroup([good(tokenizer), good(tokenizer, reward)])]
    with pytest.raises(TrainingInputError, match=r"group 1, trajectory 1: reward must be a finite number"):
        check(groups)


def test_trajectories_without_a_choice_are_context_unless_none_has_one(tokenizer: Any) -> None:
    plain = Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        reward=1.0,
    )
    check([TrajectoryGroup([good(tokenizer), plain])])  # as ART: the plain one is context
    with pytest.raises(TrainingInputError, match=r"no trajectory of any group has an assistant Choice"):
        check([TrajectoryGroup([plain, plain]), TrajectoryGroup([plain])])


def test_empty_group_and_no_groups(tokenizer: Any) -> None:
    with pytest.raises(TrainingInputError, match=r"group 1 has no trajectories \(2 rollouts raised"):
        check(
            [
                TrajectoryGroup([good(tokenizer)]),
                TrajectoryGroup([], exceptions=[ValueError("x"), KeyError("y")]),
            ]
        )
    with pytest.raises(TrainingInputError, match="no trajectory groups"):
        check([])


@pytest.mark.parametrize("change", ["drop_one", "add_one", "other_text"])
def test_logprobs_of_the_wrong_length(tokenizer: Any, change: str) -> None:
    choice = make_choice(tokenizer, "ab 12")
    entries = choice.logprobs.content
    if change == "drop_one":
        choice.logprobs.content = entries[1:]
    elif change == "add_one":
        choice.logprobs.content = [*entries, entries[0], entries[0]]
    else:
        choice.message.content = "ab 13"
    bad = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)
    with pytest.raises(
        TrainingInputError, match=r"group 0, trajectory 1, choice 0: logprobs of the wrong length"
    ) as raised:
        check([TrajectoryGroup([good(tokenizer), bad])])
    # Where the entries' text leaves the content, shown from both sides.
    expected = {
        "drop_one": "from byte 0: the content has b'ab 12', the entries b' 12'",
        "add_one": "from byte 5: the content has b'', the entries b'abab'",
        "other_text": "from byte 4: the content has b'3', the entries b'2'",
    }[change]
    assert expected in str(raised.value)


def test_choice_without_logprobs(tokenizer: Any) -> None:
    choice = make_choice(tokenizer, "a")
    choice.logprobs = None
    bare = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)
    with pytest.raises(
        TrainingInputError, match=r"group 0, trajectory 0, choice 0: the Choice has no logprobs"
    ):
        check([TrajectoryGroup([bare])])
    check([TrajectoryGroup([bare])], allow=True)


def test_non_finite_logprob(tokenizer: Any) -> None:
    choice = make_choice(tokenizer, "a 1", [-1.0, math.nan, -1.0])
    bad = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)
    with pytest.raises(
        TrainingInputError, match=r"group 0, trajectory 0, choice 0: logprob 1 must be a finite"
    ):
        check([TrajectoryGroup([bad])])


@pytest.mark.parametrize("value", [-9999.0, -1e4, 0.5])
def test_implausible_logprob(tokenizer: Any, value: float) -> None:
    # -9999 is a common stand-in for -inf; a positive logprob is not a probability.
    choice = make_choice(tokenizer, "a 1", [-1.0, value, -1.0])
    bad = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)
    with pytest.raises(
        TrainingInputError, match=r"group 0, trajectory 0, choice 0: logprob 1 is .*not a sampled token"
    ):
        check([TrajectoryGroup([bad])])
    fine = make_choice(tokenizer, "a 1", [-1.0, -900.0, 0.0])  # very low and zero are plausible
    check(
        [
            TrajectoryGroup(
                [Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, fine], reward=0.0)]
            )
        ]
    )


def test_tokens_holding_part_of_a_character(tokenizer: Any) -> None:
    # A character split over several byte tokens: the server reports each piece as U+FFFD (bytes of the
    # replacement character, not the raw bytes), so the text check cannot apply and must not refuse it.
    from art_sglang.training.tokenize import ChatTokenizer, TokenizeStats

    choice = make_choice(tokenizer, "a 🙂")
    assert any(e.token == "\ufffd" for e in choice.logprobs.content)
    ok = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)
    check([TrajectoryGroup([ok])])
    stats = TokenizeStats()
    wire = groups_to_wire([TrajectoryGroup([ok])])[0]["trajectories"][0]
    ChatTokenizer(tokenizer).tokenize_trajectory(wire, group=0, index=0, stats=stats)
    assert stats.logprob_mismatch == 0


def test_a_content_holding_fewer_replacement_characters_than_its_byte_tokens(tokenizer: Any) -> None:
    # Seen behind SGLang's router (no sampled ids): three byte tokens that form no character decode to
    # two U+FFFD in the content while each entry reports one; the text check cannot apply there either.
    choice = make_choice(tokenizer, "a 🙂")
    pieces = sum(e.token == "\ufffd" for e in choice.logprobs.content)
    assert pieces > 1
    choice.message.content = "a \ufffd"
    check(
        [
            TrajectoryGroup(
                [Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)]
            )
        ]
    )
