"""Which sequences share an optimizer step (a *row*, as ART 0.5.18 packs them) and a forward pass (a
micro-batch).

ART packs the batch's sequences into rows of `row_length` tokens and its trainer takes one optimizer step
per row. A group's sequences share their prompt (the longest common prefix, up to the first sampled
token), and ART writes it once per row, so within a row a group's later sequences count only their own
tokens. The order is random, as in ART: sequences are shuffled within each group and the rows among
themselves (torch's generator, whose state is saved in each checkpoint, so a resumed run draws the same).
Here the sequences of a row are forwarded as separate padded rows of micro-batches (the same maths as
ART's packed attention mask), each micro-batch within `TrainerConfig.micro_batch_tokens`.
"""

from __future__ import annotations

import math

import torch

from .tokenize import TokenizedSequence

ROW_ROUNDING = 2048  # ART rounds the longest sequence up to a multiple of this


def row_length(sequences: list[TokenizedSequence], *, packed: int | None, max_seq_length: int) -> int:
    """ART's packed row length: `packed` when given, else the longest sequence rounded up to a multiple of
    2048, at most max_seq_length."""
    if packed is not None:
        return packed
    longest = max(len(s.input_ids) for s in sequences)
    return min(math.ceil(longest / ROW_ROUNDING) * ROW_ROUNDING, max_seq_length)


def shared_prompt_length(sequences: list[TokenizedSequence]) -> int:
    """ART's prompt length of a group: the common prefix of its sequences, ending before the token that
    precedes the first sampled one."""
    first_sampled = min(s.sampled_mask.index(1) for s in sequences)
    common = 0
    for column in zip(*(s.input_ids for s in sequences), strict=False):
        if len(set(column)) != 1:
            break
        common += 1
    return max(min(common, first_sampled) - 1, 0)


def plan_rows(groups: list[list[TokenizedSequence]], length: int) -> list[list[TokenizedSequence]]:
    """Rows of at most `length` tokens (a group's shared prompt counted once per row), in random order."""
    rows: list[list[TokenizedSequence]] = [[]]
    used = 0
    prompts: set[int] = set()
    for index, group in enumerate(groups):
        if not group:
            continue
        prompt = shared_prompt_length(group)
        for position in torch.randperm(len(group)).tolist():
            sequence = group[position]
            cost = len(sequence.input_ids) - (prompt if index in prompts else 0)
            if rows[-1] and used + cost > length:
                rows.append([])
                used, prompts = 0, set()
                cost = len(sequence.input_ids)
            rows[-1].append(sequence)
            used += cost
            prompts.add(index)
    rows = [row for row in rows if row]
    return [rows[i] for i in torch.randperm(len(rows)).tolist()]


def plan_micro_batches(
    sequences: list[TokenizedSequence], token_budget: int
) -> list[list[TokenizedSequence]]:
    """Group sequences (longest first) so that rows × padded length stays within the token budget; a
    sequence longer than the budget gets a micro-batch of its own."""
    batches: list[list[TokenizedSequence]] = []
    for seq in sorted(sequences, key=lambda s: len(s.input_ids), reverse=True):
        # Longest first: the first sequence of a batch fixes its padded length.
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= token_budget:
            batches[-1].append(seq)
        else:
            batches.append([seq])
    return batches
