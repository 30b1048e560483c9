"""Our loss, advantages and token weights against ART 0.5.18's own code (openpipe-art): `art.loss.loss_fn`
on the same packed rows for every loss keyword this backend accepts, ART's `build_rl_train_configs` turning
the same train() keywords into its config; ART's `packed_tensors_from_tokenized_results` for the batch
normalization of weights and advantages; ART's `tokenize_trajectory_groups` for group advantages."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from training_helpers import make_choice

from art_sglang.training.advantages import balance, batch_scale, group_advantages, trajectory_weight
from art_sglang.training.loss import ROW_MEAN_EPS, TokenInputs, token_loss
from art_sglang.training.options import TrainOptions

ROWS, WIDTH = 2, 40
# (row, start, prompt length, sampled length): several sequences per row, some sampled tokens without
# sampler logprobs (NaN), as ART packs them.
LAYOUT = [(0, 0, 5, 7), (0, 12, 3, 9), (0, 24, 6, 10), (1, 0, 4, 12), (1, 16, 8, 15)]

CASES: list[dict[str, Any]] = [
    {},
    {"loss_fn": "ppo"},
    {"loss_fn": "ppo", "epsilon": 0.1, "epsilon_high": 0.3},
    {"epsilon": 0.5},
    {"epsilon": 0.3, "epsilon_high": 0.6},
    {"importance_sampling_level": "sequence"},
    {"importance_sampling_level": "average", "loss_fn": "ppo"},
    {"importance_sampling_level": "geometric_average"},
    {"max_negative_advantage_importance_sampling_weight": 1.1},
    {"mask_prob_ratio": True, "epsilon": 0.2, "epsilon_high": 0.2},
    {"mask_prob_ratio": True, "loss_fn": "ppo"},
    {"kimi_k2_tau": 0.5},
    {"kl_penalty_coef": 0.3},
    {"kl_penalty_coef": 0.3, "loss_fn": "ppo"},
    {"truncated_importance_sampling": 1.05},
    {"truncated_importance_sampling": 1.05, "precalculate_logprobs": True},
    {"loss_fn": "ppo", "importance_sampling_level": "sequence", "kl_penalty_coef": 0.1, "kimi_k2_tau": 0.2},
]


def packed_rows(seed: int) -> dict[str, torch.Tensor]:
    """ART's packed tensors (before its shift) plus the policy's, the reference's and the sampler's
    logprobs, all random."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "tokens": torch.randint(0, 50, (ROWS, WIDTH), generator=g),
        "group_ids": torch.full((ROWS, WIDTH), -1),
        "parent_ids": torch.full((ROWS, WIDTH), -1),
        "assistant_mask": torch.zeros(ROWS, WIDTH, dtype=torch.bool),
        "logprobs": torch.full((ROWS, WIDTH), math.nan),
        "advantages": torch.zeros(ROWS, WIDTH),
        "weights": torch.zeros(ROWS, WIDTH),
        "original_logprobs": torch.full((ROWS, WIDTH), math.nan),
    }
    for index, (row, start, prompt, sampled) in enumerate(LAYOUT):
        span = slice(start, start + prompt + sampled)
        answer = slice(start + prompt, start + prompt + sampled)
        out["group_ids"][row, span] = 1000 + index
        out["parent_ids"][row, span] = 500 + index
        out["assistant_mask"][row, answer] = True
        old = -torch.rand(sampled, generator=g) * 3
        old[torch.rand(sampled, generator=g) < 0.15] = math.nan  # tokens without sampler logprobs
        out["logprobs"][row, answer] = old
        out["original_logprobs"][row, answer] = old + 0.2 * torch.randn(sampled, generator=g)
        out["advantages"][row, answer] = float(torch.randn(1, generator=g))
        out["weights"][row, answer] = float(torch.rand(1, generator=g)) + 0.5
    # new/ref are aligned as ART's trainer computes them: position t holds the logprob of token t+1.
    out["new"] = torch.roll(out["logprobs"], -1, 1).nan_to_num(-1.0) + 0.3 * torch.randn(
        ROWS, WIDTH, generator=g
    )
    out["ref"] = out["new"] - 0.2 * torch.randn(ROWS, WIDTH, generator=g)
    return out


def ours(rows: dict[str, torch.Tensor], options: TrainOptions, row: int) -> tuple[float, torch.Tensor]:
    """Our loss of one row and its gradient w.r.t. the policy's logprobs (both at ART's positions)."""
    new = rows["new"][row].clone().requires_grad_(True)
    # Token t+1 sampled <=> ART's shifted mask at t.
    select = torch.zeros(WIDTH, dtype=torch.bool)
    select[:-1] = rows["assistant_mask"][row, 1:]

    def at(name: str) -> torch.Tensor:
        return torch.roll(rows[name][row], -1, 0)[select]

    tokens = int(select.sum())
    kl = (new.detach() - rows["ref"][row])[select] if options.kl_penalty_coef > 0 else None
    precalculated = options.precalculate_logprobs
    inputs = TokenInputs(
        new=new[select],
        old=new.detach()[select] if precalculated else at("logprobs"),
        advantages=at("advantages"),
        weights=at("weights"),
        sequence=at("group_ids"),
        kl=kl,
        row_kl=float(kl.sum()) / (tokens + ROW_MEAN_EPS) if kl is not None else 0.0,
        original=at("logprobs") if precalculated else None,
    )
    inputs.sequence = torch.unique(inputs.sequence, return_inverse=True)[1]
    loss = token_loss(inputs, options).loss.sum() / (tokens + ROW_MEAN_EPS)
    loss.backward()
    return float(loss), new.grad


def arts(
    art: Any, rows: dict[str, torch.Tensor], keywords: dict[str, Any], row: int
) -> tuple[float, torch.Tensor]:
    from art._backend_training import build_rl_train_configs
    from art.loss import loss_fn

    loss_name = keywords.get("loss_fn", "cispo")
    rest = {k: v for k, v in keywords.items() if k != "loss_fn"}
    _, dev_config = build_rl_train_configs(learning_rate=5e-6, ppo=loss_name == "ppo", **rest)
    names = ["tokens", "group_ids", "parent_ids", "assistant_mask", "logprobs", "advantages", "weights"]
    inputs = {name: rows[name][row : row + 1].clone() for name in names}
    if keywords.get("precalculate_logprobs"):
        # As ART's trainer: the policy's logprobs before the step become `logprobs` (ART stores them
        # unshifted: token t's logprob at t), the sampler's are kept as `original_logprobs`.
        inputs["original_logprobs"] = inputs["logprobs"]
        inputs["logprobs"] = torch.nn.functional.pad(rows["new"][row : row + 1, :-1], (1, 0), value=0.0)
    new = rows["new"][row : row + 1].clone().requires_grad_(True)
    ref = rows["ref"][row : row + 1] if keywords.get("kl_penalty_coef") else None
    result = loss_fn(inputs, new, ref, None, dev_config)
    result.policy_loss.backward()
    return float(result.policy_loss), new.grad[0]


@pytest.mark.parametrize(
    "keywords", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults"
)
def test_loss_and_gradient_equal_arts(openpipe_art: Any, keywords: dict[str, Any]) -> None:
    options = TrainOptions(**keywords)
    for seed in range(3):
        rows = packed_rows(seed)
        for row in range(ROWS):
            loss, grad = ours(rows, options, row)
            expected_loss, expected_grad = arts(openpipe_art, rows, keywords, row)
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("advantage_balance", [0.0, 0.4, -0.7])
def test_weights_and_advantages_equal_arts_packing(openpipe_art: Any, advantage_balance: float) -> None:
    from art.preprocessing.pack import packed_tensors_from_tokenized_results
    from art.preprocessing.tokenize import TokenizedResult

    rng = random.Random(3)
    # (sampled tokens, advantage) per trajectory, one sequence each; distinct token counts find each row.
    items = [(tokens, rng.uniform(-2, 2)) for tokens in rng.sample(range(2, 30), 7)]
    results = []
    for tokens, advantage in items:
        length = tokens + 3
        results.append(
            TokenizedResult(
                advantage=advantage,
                chat="",
                token_ids=list(range(length)),
                input_pos=list(range(length)),
                assistant_mask=[0] * 3 + [1] * tokens,
                logprobs=[math.nan] * 3 + [-1.0] * tokens,
                pixel_values=None,
                image_grid_thw=None,
                trajectory=None,
                choice_offsets=[],
                extra_logprobs={},
                _tokenizer=None,
                weight=trajectory_weight(tokens),
                prompt_id=rng.randint(0, 10**9),
                prompt_length=0,
            )
        )
    packed = packed_tensors_from_tokenized_results(
        results,
        64,
        truncate_long_results=False,
        advantage_balance=advantage_balance,
        verbosity=0,
        pack_results=False,
    )
    scale = batch_scale([(n, a, trajectory_weight(n)) for n, a in items], advantage_balance=advantage_balance)
    expected = {}
    for row in range(packed["tokens"].shape[0]):
        mask = packed["assistant_mask"][row]
        expected[int(mask.sum())] = (
            float(packed["advantages"][row][mask][0]),
            float(packed["weights"][row][mask][0]),
        )
    for tokens, advantage in items:
        art_advantage, art_weight = expected[tokens]
        assert trajectory_weight(tokens) * scale.weight_scale == pytest.approx(art_weight, rel=1e-5)
        assert balance(advantage, advantage_balance) * scale.advantage_scale == pytest.approx(
            art_advantage, rel=1e-5
        )


def test_group_advantages_equal_arts(openpipe_art: Any, tokenizer: Any) -> None:
    from art.preprocessing.tokenize import tokenize_trajectory_groups

    rewards = [[1.0, 0.0, 0.25, 0.5], [3.0, -1.0, 2.0]]
    for scale_rewards in (True, False):
        ours_ = group_advantages(rewards, scale_rewards=scale_rewards).per_group
        for group_rewards, mine in zip(rewards, ours_, strict=True):
            group = openpipe_art.TrajectoryGroup(
                [
                    openpipe_art.Trajectory(
                        messages_and_choices=[
                            {"role": "user", "content": f"p{r}"},
                            make_choice(tokenizer, f"a {r}"),
                        ],
                        reward=r,
                    )
                    for r in group_rewards
                ]
            )
            results = list(tokenize_trajectory_groups(tokenizer, [group], False, scale_rewards))
            by_reward = {result.trajectory.reward: result.advantage for result in results}
            assert mine is not None
            for reward, advantage in zip(group_rewards, mine, strict=True):
                assert advantage == pytest.approx(by_reward[reward], rel=1e-12)
