"""`train()` keyword arguments as ART's `LocalBackend.train` takes them, turned into `TrainOptions`.

ART programs pass options that only make sense in ART's own trainer. Each such option is accepted when
it has ART's default value (it changes nothing) and refused otherwise, with a message naming what to do
instead: an option that is silently ignored would make a run differ from what its author asked for.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .errors import ConfigError
from .training.options import TrainOptions

# ART LocalBackend.train options this backend does not implement: ART's default, and the advice given.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "loss_fn_config": (None, "loss_fn='ppo' takes no extra config; use epsilon/epsilon_high"),
    "adam_params": (None, "the optimizer is AdamW with the step's learning_rate"),
    "kl_penalty_reference_step": (None, "kl_penalty_coef penalizes divergence from the base model only"),
    "kl_ref_adapter_path": (None, "kl_penalty_coef penalizes divergence from the base model only"),
    "advantage_balance": (0.0, "advantages are group-relative and balanced"),
    "importance_sampling_level": ("token", "importance weights are per token"),
    "max_negative_advantage_importance_sampling_weight": (None, "use epsilon/epsilon_high to clip"),
    "mask_prob_ratio": (False, "use epsilon/epsilon_high to clip"),
    "kimi_k2_tau": (None, "use loss_fn='ppo'"),
    "precalculate_logprobs": (False, "the trainer computes logprobs in the same pass"),
    "plot_tensors": (False, "see the metrics in TrainResult and history.jsonl"),
    "truncated_importance_sampling": (None, "use epsilon/epsilon_high to clip"),
    "scale_learning_rate_by_reward_std_dev": (False, "set learning_rate per step yourself"),
    "logprob_calculation_chunk_size": (1024, "set TrainerConfig(micro_batch_tokens=...)"),
    "packed_sequence_length": (None, "set TrainerConfig(max_seq_length=..., micro_batch_tokens=...)"),
    "num_trajectories_learning_rate_multiplier_power": (0.0, "set learning_rate per step yourself"),
}


def build_train_options(
    *,
    learning_rate: float,
    loss_fn: str,
    epsilon: float | None,
    epsilon_high: float | None,
    scale_rewards: bool,
    normalize_advantages: bool,
    kl_penalty_coef: float,
    max_grad_norm: float | None,
    allow_training_without_logprobs: bool,
    save_checkpoint: bool,
    extra: dict[str, Any],
) -> TrainOptions:
    """Validate every option before anything runs; `ConfigError` names the option and the fix."""
    check_unsupported(extra)
    if loss_fn != "ppo":
        raise ConfigError(
            f"loss_fn={loss_fn!r} is not supported by SGLangBackend: use loss_fn='ppo' "
            "(clipped importance-weighted policy gradient; tune it with epsilon/epsilon_high)"
        )
    values: dict[str, Any] = {
        "learning_rate": learning_rate,
        "loss_fn": loss_fn,
        "epsilon_high": epsilon_high,
        # As in ART, normalize_advantages=False is the older name for not dividing by the group's std.
        "scale_rewards": scale_rewards and normalize_advantages,
        "kl_penalty_coef": kl_penalty_coef,
        "max_grad_norm": max_grad_norm,
        "allow_training_without_logprobs": allow_training_without_logprobs,
        "save_checkpoint": save_checkpoint,
    }
    if epsilon is not None:
        values["epsilon"] = epsilon
    try:
        return TrainOptions(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}={e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid train() option: {problems}") from None


def check_unsupported(extra: dict[str, Any]) -> None:
    for name, value in extra.items():
        if name not in UNSUPPORTED:
            raise ConfigError(
                f"train() got an unknown option {name!r}; SGLangBackend.train takes learning_rate, loss_fn, "
                "epsilon, epsilon_high, scale_rewards, normalize_advantages, kl_penalty_coef, "
                "max_grad_norm, allow_training_without_logprobs, save_checkpoint, verbose"
            )
        default, advice = UNSUPPORTED[name]
        if value != default:
            raise ConfigError(
                f"train() option {name}={value!r} is not supported by SGLangBackend "
                f"(only its default {default!r} is accepted): {advice}"
            )
