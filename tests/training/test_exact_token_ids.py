"""Choices that carry the ids the server sampled (`token_ids`) are trained on exactly those ids, with the
sampler's logprobs 1:1, whatever a re-tokenization of their text would give."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice
from training_helpers import make_choice, sampled

from art_sglang.errors import TrainingInputError
from art_sglang.training.tokenize import ChatTokenizer, TokenizeStats, tokenize_groups
from art_sglang.training.validation import for_trainer, groups_to_wire, logprob_entries, validate_groups
from art_sglang.trajectories import Trajectory, TrajectoryGroup


def wire(choice: Choice) -> dict[str, Any]:
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice], reward=0.0)
    return groups_to_wire([TrajectoryGroup([trajectory])])[0]["trajectories"][0]


def choice_trajectory(choice: Choice) -> Trajectory:
    return Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=0.0)


def check(*groups: list[Choice]) -> None:
    wire_groups = groups_to_wire([TrajectoryGroup([choice_trajectory(c) for c in g]) for g in groups])
    validate_groups(wire_groups, allow_training_without_logprobs=False)


def trained(seq: Any) -> tuple[list[int], list[float]]:
    pairs = [(t, lp) for t, lp, m in zip(seq.input_ids, seq.old_logprobs, seq.sampled_mask, strict=True) if m]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


@pytest.mark.parametrize("eot_in_ids", [False, True])
def test_the_sampled_ids_are_trained_not_a_retokenization(
    chat: ChatTokenizer, tokenizer: Any, eot_in_ids: bool
) -> None:
    ids = tokenizer.encode("h", add_special_tokens=False) + tokenizer.encode("ello", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello" and ids != tokenizer.encode("hello", add_special_tokens=False)
    eot = tokenizer.eos_token_id
    # The stop token's logprob comes as one entry more, or with the stop token inside the ids.
    choice = sampled(tokenizer, [*ids, eot] if eot_in_ids else ids, [-0.1, -0.2, -0.3, -0.9])
    if not eot_in_ids:
        choice.logprobs.content.append(choice.logprobs.content[0].model_copy(update={"logprob": -0.9}))
    check([choice])
    stats = TokenizeStats()
    [seq] = chat.tokenize_trajectory(wire(choice), group=0, index=0, stats=stats)
    assert trained(seq) == ([*ids, eot], pytest.approx([-0.1, -0.2, -0.3, -0.9]))
    # Around them: the template's prompt and trailer, untrained and without sampler logprobs.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    head = tokenizer.encode(prompt, add_special_tokens=False)
    assert seq.input_ids[: len(head)] == head and seq.input_ids[len(head) : len(head) + 4] == [*ids, eot]
    assert seq.sampled_mask == [0] * len(head) + [1] * 4 + [0] * (len(seq.input_ids) - len(head) - 4)
    assert all(math.isnan(lp) for lp, m in zip(seq.old_logprobs, seq.sampled_mask, strict=True) if not m)
    assert stats.exact_ids == 1 and stats.logprob_mismatch == 0
    assert stats.metrics()["tokenize/exact_ids"] == 1.0 and stats.metrics()["tokenize/retokenized"] == 0.0


def test_a_length_cut_choice_does_not_train_the_end_of_turn_token(
    chat: ChatTokenizer, tokenizer: Any
) -> None:
    ids = tokenizer.encode("ab 12", add_special_tokens=False)
    choice = sampled(tokenizer, ids, [-1.0] * len(ids), finish_reason="length")
    [seq] = chat.tokenize_trajectory(wire(choice), group=0, index=0, stats=TokenizeStats())
    assert trained(seq) == (ids, [-1.0] * len(ids))


@pytest.mark.parametrize("entries", [2, 5])
def test_logprobs_not_one_per_id_are_an_input_error(tokenizer: Any, entries: int) -> None:
    ids = tokenizer.encode("ab 1", add_special_tokens=False)
    assert len(ids) == 3
    choice = sampled(tokenizer, ids, [-1.0] * 3)
    choice.logprobs.content = (choice.logprobs.content * 2)[:entries]
    good = sampled(tokenizer, ids, [-1.0] * 3)
    with pytest.raises(
        TrainingInputError,
        match=r"group 1, trajectory 1, choice 0: logprobs of the wrong length: "
        rf"{entries} logprob entries for 3 sampled token_ids",
    ):
        check([good], [good, choice])


def test_a_choice_holding_part_of_a_character_is_accepted_with_its_ids(
    chat: ChatTokenizer, tokenizer: Any
) -> None:
    # As in the golden recording: the text starts with U+FFFD (the ids hold only part of a character) and
    # two byte tokens are each reported as U+FFFD, so the entries do not spell the text.
    ids = tokenizer.encode("🙂", add_special_tokens=False)[:2] + tokenizer.encode(
        "30", add_special_tokens=False
    )
    choice = sampled(tokenizer, ids, [-0.5] * len(ids), finish_reason="length")
    choice.message.content = "\ufffd30"
    assert [e.token for e in choice.logprobs.content[:2]] == ["\ufffd", "\ufffd"]
    check([choice])
    [seq] = chat.tokenize_trajectory(wire(choice), group=0, index=0, stats=TokenizeStats())
    assert trained(seq) == (ids, [-0.5] * len(ids))
    # Without its ids (a server that returns none, or SGLang's router reached without the gateway) it is not refused either: its text is tokenized again,
    # and its sampler logprobs, which belong to other tokens, are left out.
    without_ids = choice.model_copy(update={"token_ids": None})
    check([without_ids])
    stats = TokenizeStats()
    chat.tokenize_trajectory(wire(without_ids), group=0, index=0, stats=stats)
    assert (stats.choices, stats.exact_ids, stats.logprob_mismatch) == (1, 0, 1)


def test_the_worker_is_sent_only_what_it_reads_and_trains_the_same(
    chat: ChatTokenizer, tokenizer: Any
) -> None:
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    exact = sampled(tokenizer, ids, [-0.5] * len(ids))
    text = make_choice(tokenizer, "general kenobi")  # no ids: its entries are checked against the text
    for choice in (exact, text):
        for entry in choice.logprobs.content:
            entry.top_logprobs = [entry.model_copy(update={"top_logprobs": []})] * 3
    wire = groups_to_wire([TrajectoryGroup([choice_trajectory(exact), choice_trajectory(text)])])
    full = copy.deepcopy(wire)
    slim = for_trainer(wire)
    sent_exact, sent_text = (t["messages_and_choices"][1]["logprobs"] for t in slim[0]["trajectories"])
    assert list(sent_exact) == ["packed_float64"]  # the values only, as bytes
    assert logprob_entries({"logprobs": sent_exact}) == [{"logprob": -0.5}] * len(ids)
    sent_text = sent_text["content"]
    assert all(set(e) == {"token", "bytes", "logprob"} for e in sent_text) and len(sent_text) > 1
    assert wire == full  # the caller's groups are left as they were
    validate_groups(slim, allow_training_without_logprobs=False)
    # The worker tokenizes the slim groups into the same sequences, sampler logprobs included.
    (got,), _ = tokenize_groups(chat, slim)
    (expected,), _ = tokenize_groups(chat, wire)
    assert [[(s.input_ids, s.sampled_mask) for s in t] for t in got] == [
        [(s.input_ids, s.sampled_mask) for s in t] for t in expected
    ]
    assert [[[str(lp) for lp in s.old_logprobs] for s in t] for t in got] == [
        [[str(lp) for lp in s.old_logprobs] for s in t] for t in expected
    ]
