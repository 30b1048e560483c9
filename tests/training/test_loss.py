"""The loss against hand-computed values: ART's CISPO (the ratio clipped and detached, the gradient
through the logprob), PPO's clipped surrogate, and the logprobs of sampled tokens only. Parity with ART's
own code, keyword by keyword: test_art_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from art_sglang.training.loss import ROW_MEAN_EPS, TokenInputs, sampled_token_logprobs, token_loss
from art_sglang.training.options import TrainOptions


def test_cispo_by_hand() -> None:
    # Three tokens of one sequence, ART's CISPO defaults: clip the ratio to [1 - 1.0, 1 + 4.0] = [0, 5],
    # detached; loss = -clip(r)·A·new·weight, summed and divided by (3 + 1e-6).
    new = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.8)], requires_grad=True)
    old = torch.tensor([math.log(0.05), math.nan, math.log(0.8)])  # r = 10 (clipped to 5), 1 (no logprob), 1
    adv = torch.tensor([1.0, -2.0, 0.5])
    weights = torch.tensor([1.0, 1.0, 2.0])
    terms = token_loss(
        TokenInputs(
            new=new, old=old, advantages=adv, weights=weights, sequence=torch.zeros(3, dtype=torch.long)
        ),
        TrainOptions(),
    )
    expected = [-5 * 1.0 * math.log(0.5), -1 * -2.0 * math.log(0.25), -1 * 0.5 * math.log(0.8) * 2.0]
    assert terms.loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.ratio.tolist() == pytest.approx([10.0, 1.0, 1.0], rel=1e-5)
    assert terms.clipped.tolist() == [True, False, False]
    (terms.loss.sum() / (3 + ROW_MEAN_EPS)).backward()
    # d/d(new) = -clip(r)·A·weight / 3: the clipped token still gets a gradient (unlike PPO).
    assert new.grad.tolist() == pytest.approx([-5 / 3, 2 / 3, -1 / 3], rel=1e-5)


def test_ppo_by_hand_gives_no_gradient_where_clipped() -> None:
    new = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1)], requires_grad=True)
    inputs = TokenInputs(
        new=new,
        old=torch.zeros(3),
        advantages=torch.tensor([1.0, -1.0, 1.0]),
        weights=torch.ones(3),
        sequence=torch.zeros(3, dtype=torch.long),
    )
    terms = token_loss(inputs, TrainOptions(loss_fn="ppo"))  # epsilon 0.2: range [0.8, 1.2]
    assert terms.loss.tolist() == pytest.approx([-1.2, 0.8, -1.1], abs=1e-6)
    terms.loss.sum().backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.0, -1.1], abs=1e-6)


def test_sampled_token_logprobs_picks_masked_targets_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    ids = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])
    got = sampled_token_logprobs(logits, ids, mask)
    logp = logits.log_softmax(-1)
    # token t is predicted by the logits at t-1
    expected = [logp[0, 1, 2], logp[0, 2, 3], logp[1, 0, 3]]
    assert got.tolist() == pytest.approx([float(x) for x in expected], abs=1e-6)
