"""Tokenization with the tiny model's real tokenizer and ChatML template: only tokens the model sampled
carry mask 1; sampler logprobs land on exactly those tokens; the mismatch policy and length limit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from training_helpers import make_choice

from art_sglang.chat_format import template_tools
from art_sglang.training.tokenize import ChatTokenizer, TokenizeStats, tokenize_groups
from art_sglang.training.validation import groups_to_wire
from art_sglang.trajectories import Trajectory, TrajectoryGroup


def wire(trajectory: Trajectory) -> dict[str, Any]:
    return groups_to_wire([TrajectoryGroup([trajectory])])[0]["trajectories"][0]


def sampled_text(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive mask-1 tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_only_sampled_choices_are_trained(chat: ChatTokenizer, tokenizer: Any) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    first = make_choice(tokenizer, "call 12", [-0.1, -0.2, -0.3, -0.4])
    second = make_choice(tokenizer, "done 7", finish_reason="length")
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "add 5"},
            {"role": "assistant", "content": "plain context answer"},
            {"role": "user", "content": "again"},
            first,
            {"role": "tool", "content": "result 99", "tool_call_id": "x"},
            second,
        ],
        tools=tools,
        reward=1.0,
    )
    stats = TokenizeStats()
    sent = wire(trajectory)
    [seq] = chat.tokenize_trajectory(sent, group=0, index=0, stats=stats)
    # The whole conversation is the template's rendering, tools included in SGLang's form of them.
    rendered = tokenizer.apply_chat_template(
        [
            m if isinstance(m, dict) else {"role": "assistant", "content": m.message.content}
            for m in trajectory.messages_and_choices
        ],
        tools=template_tools(sent["tools"]),
        tokenize=False,
    )
    assert '"name": "add"' in rendered
    assert tokenizer.decode(seq.input_ids) == rendered
    # Mask 1: the first choice with its end-of-turn token (it stopped), the second without (length).
    assert sampled_text(tokenizer, seq.input_ids, seq.sampled_mask) == ["call 12<|im_end|>", "done 7"]
    # The sampler logprobs sit on the first choice's tokens; the rest has none (NaN).
    known = [(t, lp) for t, lp in zip(seq.input_ids, seq.old_logprobs, strict=True) if not math.isnan(lp)]
    assert [lp for _, lp in known[:4]] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert tokenizer.decode([t for t, _ in known[:4]]) == "call 12"
    assert all(lp == -1.0 for _, lp in known[4:]) and len(known) == 4 + len(tokenizer.encode("done 7"))
    assert stats.choices == 2 and stats.logprob_mismatch == 0


def test_trailing_stop_token_logprob_is_used(chat: ChatTokenizer, tokenizer: Any) -> None:
    choice = make_choice(tokenizer, "ab 1", [-0.5, -0.6, -0.7])
    choice.logprobs.content.append(
        choice.logprobs.content[0].model_copy(
            update={"token": "<|im_end|>", "bytes": list(b"<|im_end|>"), "logprob": -0.9}
        )
    )
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice], reward=0.0)
    [seq] = chat.tokenize_trajectory(wire(trajectory), group=0, index=0, stats=TokenizeStats())
    trained = [lp for lp, m in zip(seq.old_logprobs, seq.sampled_mask, strict=True) if m]
    assert trained == pytest.approx([-0.5, -0.6, -0.7, -0.9])


def test_retokenization_mismatch_drops_sampler_logprobs(chat: ChatTokenizer, tokenizer: Any) -> None:
    # The sampler produced "12" as one token "12" (a split this tokenizer would not make): same text,
    # another token count -> the policy: no sampler logprobs for this choice, counted.
    choice = make_choice(tokenizer, "12")
    assert len(choice.logprobs.content) == 2
    merged = choice.logprobs.content[0].model_copy(
        update={"token": "12", "bytes": list(b"12"), "logprob": -3.0}
    )
    choice.logprobs.content = [merged]
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice], reward=0.0)
    stats = TokenizeStats()
    [seq] = chat.tokenize_trajectory(wire(trajectory), group=0, index=0, stats=stats)
    assert stats.logprob_mismatch == 1
    assert sum(seq.sampled_mask) == 3  # "1", "2", <|im_end|>
    assert all(math.isnan(lp) for lp in seq.old_logprobs)


def test_template_that_rewrites_history_splits_sequences(tokenizer: Any, tiny_model_path: Path) -> None:
    # A template that renders earlier assistant turns as "..." (as reasoning templates drop old thoughts):
    # the second prompt no longer extends the first rendering, so each choice gets its own sequence.
    import copy

    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTokenizer.for_model(rewriting, tiny_model_path)
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "a"},
            make_choice(tokenizer, "one"),
            {"role": "user", "content": "b"},
            make_choice(tokenizer, "two"),
        ],
        reward=0.0,
    )
    seqs = chat.tokenize_trajectory(wire(trajectory), group=0, index=0, stats=TokenizeStats())
    assert [sampled_text(tokenizer, s.input_ids, s.sampled_mask) for s in seqs] == [
        ["one<|im_end|>"],
        ["two<|im_end|>"],
    ]
    assert "..." in tokenizer.decode(seqs[1].input_ids)


def test_tool_call_choice_is_trained_with_its_logprobs(chat: ChatTokenizer, tokenizer: Any) -> None:
    # The server parsed the sampled text into a tool call (content None); the template renders the call
    # back, with the arguments as a JSON object, and that rendering is what gets trained.
    sampled = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    ids = tokenizer.encode(sampled, add_special_tokens=False)
    entries = [{"token": tokenizer.decode([i]), "logprob": -0.25, "top_logprobs": []} for i in ids]
    entries.append({"token": "<|im_end|>", "logprob": -0.5, "top_logprobs": []})
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    choice = {
        "index": 0,
        "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "tool_calls": [call]},
        "logprobs": {"content": entries},
    }
    trajectory = {"messages_and_choices": [{"role": "user", "content": "add"}, choice], "reward": 1.0}
    stats = TokenizeStats()
    [seq] = chat.tokenize_trajectory(trajectory, group=0, index=0, stats=stats)
    assert sampled_text(tokenizer, seq.input_ids, seq.sampled_mask) == [sampled + "<|im_end|>"]
    trained = [lp for lp, m in zip(seq.old_logprobs, seq.sampled_mask, strict=True) if m]
    assert trained == [-0.25] * len(ids) + [-0.5] and stats.logprob_mismatch == 0
    # Entries that do not fit the rendered call: the mismatch policy, not an error.
    choice["logprobs"] = {"content": entries[:3]}
    [seq] = chat.tokenize_trajectory(trajectory, group=0, index=0, stats=stats)
    assert stats.logprob_mismatch == 1 and all(math.isnan(lp) for lp in seq.old_logprobs)


def test_the_vocabulary_is_walked_once_not_per_call(tokenizer: Any, tiny_model_path: Path) -> None:
    """The length bound's longest vocabulary entry is read once per trainer (a 152k vocabulary took ~0.15 s
    of every train call), and still bounds: a message that cannot fit is skipped untokenized."""
    walks = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def get_vocab(self) -> dict[str, int]:
            walks.append(1)
            return tokenizer.get_vocab()

    chat = ChatTokenizer.for_model(Counting(), tiny_model_path)
    fits = wire(
        Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, make_choice(tokenizer, "ok")])
    )
    huge = wire(
        Trajectory(
            messages_and_choices=[{"role": "user", "content": "x" * 100_000}, make_choice(tokenizer, "ok")]
        )
    )
    for _ in range(3):
        (kept, skipped), stats = tokenize_groups(
            chat, [{"trajectories": [fits]}, {"trajectories": [huge]}], max_seq_length=512
        )
        assert kept[0] and skipped == [[]] and stats.too_long_skipped == 1
    assert len(walks) == 1
