"""The loss terms against hand-computed values: PPO clipping (symmetric and asymmetric), the k3 KL
estimator, the logprobs of sampled tokens only, and micro-batch accumulation to the exact token-mean."""

from __future__ import annotations

import math

import pytest
import torch

from art_sglang.training.loss import (
    batch_loss_sum,
    grpo_token_loss,
    k3_kl,
    ppo_token_loss,
    sampled_token_logprobs,
)

LN = math.log


def test_ppo_clip_symmetric() -> None:
    # ratios 1.5, 0.5, 1.1, 0.9 (new - old = ln r); advantages +1, -1, +1, -1; epsilon 0.2
    old = torch.zeros(4)
    new = torch.tensor([LN(1.5), LN(0.5), LN(1.1), LN(0.9)])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio, clipped = ppo_token_loss(new, old, adv, epsilon=0.2, epsilon_high=0.2)
    # r=1.5, A=+1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped
    # r=1.1, A=+1: inside the range -> -1.1; r=0.9, A=-1 -> 0.9
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -1.1, 0.9], abs=1e-6)
    assert clipped.tolist() == [True, True, False, False]
    assert ratio.tolist() == pytest.approx([1.5, 0.5, 1.1, 0.9], abs=1e-6)


def test_ppo_clip_asymmetric_and_gradient() -> None:
    # epsilon 0.1 below, 0.3 above: r=1.25, A=+1 stays unclipped (would clip at eps 0.2);
    # r=0.85, A=-1 is clipped at 0.9 -> loss 0.9.
    old = torch.zeros(2)
    new = torch.tensor([LN(1.25), LN(0.85)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, _, clipped = ppo_token_loss(new, old, adv, epsilon=0.1, epsilon_high=0.3)
    assert loss.tolist() == pytest.approx([-1.25, 0.9], abs=1e-6)
    assert clipped.tolist() == [False, True]
    loss.sum().backward()
    # d(-r·A)/d(new) = -A·r for the unclipped token; zero where clipped.
    assert new.grad.tolist() == pytest.approx([-1.25, 0.0], abs=1e-6)


def test_missing_old_logprobs_mean_ratio_one() -> None:
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([float("nan"), -2.0])
    loss, ratio, _ = ppo_token_loss(new, old, torch.tensor([2.0, 2.0]), epsilon=0.2, epsilon_high=0.2)
    assert ratio.tolist() == pytest.approx([1.0, 1.0])
    assert loss.tolist() == pytest.approx([-2.0, -2.0])
    loss.sum().backward()
    assert new.grad.tolist() == pytest.approx([-2.0, -2.0])  # -A·r: the gradient still flows


def test_k3_kl() -> None:
    new = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    # d = ref - new: 0, 1, -1 -> e^d - d - 1: 0, e - 2, e^-1
    expected = [0.0, math.e - 2, math.exp(-1)]
    assert k3_kl(new, ref).tolist() == pytest.approx(expected, abs=1e-6)
    terms = grpo_token_loss(new, new, torch.zeros(3), ref, epsilon=0.2, epsilon_high=0.2)
    assert float(batch_loss_sum(terms, 0.5)) == pytest.approx(0.5 * sum(expected), abs=1e-6)
    assert float(batch_loss_sum(terms, 0.0)) == pytest.approx(0.0, abs=1e-6)


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
