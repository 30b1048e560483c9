"""The GRPO-style loss on sampled tokens: PPO-clipped importance-weighted policy gradient plus an optional
k3 KL penalty to the base model. All functions work on flat tensors of the sampled tokens of a batch;
the caller divides sums by the number of sampled tokens in the *whole* batch, so micro-batches
accumulate to the exact token-mean."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLoss:
    """Per-token terms (flat over sampled tokens)."""

    policy: torch.Tensor  # -min(r·A, clip(r)·A)
    ratio: torch.Tensor  # exp(new - old), detached
    clipped: torch.Tensor  # bool: the clipped branch was taken (the gradient is zero there)
    kl: torch.Tensor | None  # k3 estimate of KL(new || ref), None when no reference


def ppo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ratio, clipped) per token. `old_logprobs` may hold NaN where the sampler gave none: the
    detached new logprob stands in there, i.e. ratio 1."""
    old = torch.where(torch.isnan(old_logprobs), new_logprobs.detach(), old_logprobs)
    ratio = torch.exp(new_logprobs - old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, ratio.detach(), (clipped < unclipped).detach()


def k3_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(new || ref): exp(ref - new) - (ref - new) - 1 (>= 0, unbiased)."""
    delta = ref_logprobs - new_logprobs
    return torch.exp(delta) - delta - 1.0


def grpo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    *,
    epsilon: float,
    epsilon_high: float,
) -> TokenLoss:
    policy, ratio, clipped = ppo_token_loss(
        new_logprobs, old_logprobs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
    )
    kl = k3_kl(new_logprobs, ref_logprobs) if ref_logprobs is not None else None
    return TokenLoss(policy=policy, ratio=ratio, clipped=clipped, kl=kl)


def batch_loss_sum(terms: TokenLoss, kl_coef: float) -> torch.Tensor:
    """Sum over tokens of policy + kl_coef·kl; divide by the batch's sampled-token count for the mean."""
    total = terms.policy.sum()
    if terms.kl is not None and kl_coef > 0:
        total = total + kl_coef * terms.kl.sum()
    return total


def sampled_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logprobs of the tokens where `mask` is 1, flat in row-major order. Logits at t predict token t+1;
    only the selected rows are upcast to float32 (the full-vocab float copy would not fit on a GPU)."""
    select = mask[:, 1:].bool()
    rows = logits[:, :-1][select].float()
    targets = input_ids[:, 1:][select]
    return rows.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
