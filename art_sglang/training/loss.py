"""The RL loss of ART 0.5.18 (`art.loss.loss_fn`), on the flat tensor of a micro-batch's sampled tokens.

Per token, with r = exp(new − old) (old = new, detached, where the sampler gave no logprob):
- importance_sampling_level "sequence" replaces r by exp(mean of the sequence's log-ratios); "average"
  and "geometric_average" mix the two;
- max_negative_advantage_importance_sampling_weight caps r; mask_prob_ratio zeroes r outside the clip
  range; kimi_k2_tau subtracts tau·(new − old) from the advantage;
- kl_penalty_coef adds coef·(mean KL − token KL) to the advantage, KL = new − ref (detached), the mean
  taken over the row (the tokens of one optimizer step);
- cispo: −clip(r, 1 − ε, 1 + ε_high).detach() · A · new; ppo: −min(r·A, clip(r)·A);
- truncated_importance_sampling multiplies by min(r', bound).detach(), r' = old / sampler ratio when the
  old logprobs were precalculated, else r;
- finally × the token's weight. The caller sums over the row's tokens and divides by (row tokens + 1e-6),
  so micro-batches of one row add up to ART's mean over the packed row exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..constraints import SamplingConstraint
from ..errors import TrainingInputError
from ..grammars import BITS, GrammarStep, TokenConstraint, unpack
from .options import TrainOptions

SEQUENCE_MEAN_EPS = 1e-8  # as art.utils.group_aggregate
ROW_MEAN_EPS = 1e-6  # as art.loss.loss_fn's denominator


@dataclass
class TokenInputs:
    """Flat over the sampled tokens of a micro-batch (same order everywhere)."""

    new: torch.Tensor  # the policy's logprobs, with gradient
    old: torch.Tensor  # the old logprobs (NaN: unknown)
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence: torch.Tensor  # long: which sequence of the micro-batch each token belongs to
    kl: torch.Tensor | None = None  # new − ref, detached; None without a KL penalty
    row_kl: float = 0.0  # mean of `kl` over the whole row
    original: torch.Tensor | None = None  # the sampler's logprobs when `old` was precalculated


@dataclass
class TokenLoss:
    loss: torch.Tensor  # per token, weighted: sum and divide by (row tokens + ROW_MEAN_EPS)
    ratio: torch.Tensor  # the importance ratio the loss used, detached
    clipped: torch.Tensor  # bool: outside the clip range (cispo) / clipped branch taken (ppo)


def token_loss(inputs: TokenInputs, options: TrainOptions) -> TokenLoss:
    new = inputs.new
    old = torch.where(torch.isnan(inputs.old), new.detach(), inputs.old)
    diff = new - old
    ratio = torch.exp(diff)
    level = options.importance_sampling_level
    if level != "token":
        sequence_ratio = torch.exp(_sequence_mean(diff, inputs.sequence))
        if level == "sequence":
            ratio = sequence_ratio
        elif level == "average":
            ratio = (ratio + sequence_ratio) / 2
        else:  # geometric_average
            ratio = (ratio**0.5) * (sequence_ratio**0.5)
    epsilon, epsilon_high = options.clip
    low, high = 1 - epsilon, 1 + epsilon_high
    if cap := options.max_negative_advantage_importance_sampling_weight:
        ratio = torch.clamp(ratio, max=cap)
    if options.mask_prob_ratio:
        ratio = torch.where((ratio > low) & (ratio < high), ratio, 0.0)
    advantages = inputs.advantages
    if tau := options.kimi_k2_tau:
        advantages = advantages - tau * diff.detach()
    if options.kl_penalty_coef > 0 and inputs.kl is not None:
        advantages = advantages + options.kl_penalty_coef * (inputs.row_kl - inputs.kl)
    clipped_ratio = torch.clip(ratio.detach() if options.loss_fn == "cispo" else ratio, low, high)
    if options.loss_fn == "ppo":
        unclipped, clipped = ratio * advantages, clipped_ratio * advantages
        loss = -torch.min(unclipped, clipped)
        was_clipped = clipped < unclipped
    else:
        loss = -(clipped_ratio * advantages * new)
        was_clipped = (ratio < low) | (ratio > high)
    if bound := options.truncated_importance_sampling:
        truncation = ratio
        if inputs.original is not None:
            original = torch.where(torch.isnan(inputs.original), new.detach(), inputs.original)
            truncation = torch.exp(old - original)
        loss = loss * torch.clamp(truncation, max=bound).detach()
    return TokenLoss(loss * inputs.weights, ratio.detach(), was_clipped.detach())


def _sequence_mean(values: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """Each token's value replaced by the mean over its sequence (broadcast back to the tokens)."""
    count = int(sequence.max()) + 1 if sequence.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence, values)
    counts = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(
        0, sequence, torch.ones_like(values)
    )
    return (sums / (counts + SEQUENCE_MEAN_EPS))[sequence]


def sampled_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    constraints: Sequence[TokenConstraint | None] | None = None,
) -> torch.Tensor:
    """Logprobs of the tokens where `mask` is 1, flat in row-major order, each under its sampling
    constraint when `constraints` (same order) gives one. Logits at t predict token t+1; only the selected
    rows are upcast to float32 (the full-vocab float copy would not fit on a GPU)."""
    select = mask[:, 1:].bool()
    rows = logits[:, :-1][select].float()
    if constraints is not None and any(c is not None for c in constraints):
        rows = constrain_rows(rows, constraints)
    targets = input_ids[:, 1:][select]
    return rows.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def constrain_rows(rows: torch.Tensor, constraints: Sequence[TokenConstraint | None]) -> torch.Tensor:
    """The logits `rows` (one per sampled token, float32) with each token's sampling constraint applied as
    SGLang applied it before taking the logprob (constraints.py): its bias added, every token outside its
    allowed set or outside its grammar step's mask at -inf."""
    # Grouped by object (a Choice's tokens share one): hashing a large allowed set per token would cost.
    plain: dict[int, tuple[SamplingConstraint, list[int]]] = {}
    steps: list[int] = []
    for index, constraint in enumerate(constraints):
        if isinstance(constraint, GrammarStep):
            steps.append(index)
            constraint = constraint.base
        if constraint is not None:
            plain.setdefault(id(constraint), (constraint, []))[1].append(index)
    for constraint, where in plain.values():
        rows = _apply_constraint(rows, constraint, where)
    if steps:
        index = torch.tensor(steps, device=rows.device)
        packed = torch.stack([constraints[i].bitmask for i in steps]).to(rows.device)  # type: ignore[union-attr]
        bits = unpack(packed, min(rows.shape[-1], packed.shape[-1] * BITS))
        allowed = torch.zeros(len(steps), rows.shape[-1], dtype=torch.bool, device=rows.device)
        allowed[:, : bits.shape[-1]] = bits  # tokens past the grammar's vocabulary are never allowed
        rows = rows.index_copy(0, index, rows.index_select(0, index).masked_fill(~allowed, float("-inf")))
    return rows


def _apply_constraint(rows: torch.Tensor, constraint: SamplingConstraint, where: list[int]) -> torch.Tensor:
    vocab = rows.shape[-1]
    ids = [t for t, _ in constraint.logit_bias] + list(constraint.allowed_token_ids or ())
    if ids and max(ids) >= vocab:
        raise TrainingInputError(
            f"a rollout's constraint ({constraint.describe()}) names token {max(ids)}, outside the "
            f"model's vocabulary (0..{vocab - 1})"
        )
    index = torch.tensor(where, device=rows.device)
    picked = rows.index_select(0, index)
    if constraint.logit_bias:
        tokens, values = zip(*constraint.logit_bias, strict=True)
        bias = torch.zeros(vocab, dtype=rows.dtype, device=rows.device)
        bias[list(tokens)] = torch.tensor(values, dtype=rows.dtype, device=rows.device)
        picked = picked + bias
    if constraint.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=rows.device)
        keep[list(constraint.allowed_token_ids)] = True
        picked = picked.masked_fill(~keep, float("-inf"))
    return rows.index_copy(0, index, picked)
