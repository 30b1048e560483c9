"""`TrainOptions`: the keywords of `train()`, defined once, with ART 0.5.18 `LocalBackend.train`'s names and
defaults; and `StepOutcome`, what a step reports back.

`SGLangBackend.train(model, groups, **options)`, `TrainableModel.train(..., _config=...)`, the worker
protocol and docs/configuration.md all derive from this model. A keyword of ART's that this trainer
cannot honour is a field too, with ART's default as its only accepted value: any other value is a
`ConfigError` that names the option and what to do instead.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError

LossFn = Literal["cispo", "ppo"]
ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]
# ART's clip defaults per loss: (epsilon, epsilon_high); None = epsilon.
EPSILON_DEFAULTS: dict[str, tuple[float, float | None]] = {"cispo": (1.0, 4.0), "ppo": (0.2, None)}
_REFUSED = "refused"


def _refused(default: Any, advice: str) -> Any:
    """An ART keyword this trainer does not implement: only ART's default is accepted."""
    return Field(
        default,
        description=f"Not supported (only {default!r}): {advice}.",
        json_schema_extra={_REFUSED: advice},
    )


class TrainOptions(BaseModel):
    """Keywords of `backend.train(model, groups, **options)`, as ART 0.5.18's `LocalBackend.train` (the
    model shape, optimizer and memory knobs live in `TrainerConfig`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate of this step.")
    loss_fn: LossFn = Field(
        "cispo",
        description="'cispo': clipped importance-weight policy optimization (the ratio is clipped and "
        "detached, the gradient flows through the logprob); 'ppo': PPO's clipped surrogate.",
    )
    loss_fn_config: None = _refused(None, "use epsilon/epsilon_high and the other keywords")
    normalize_advantages: bool = Field(True, description="False: as scale_rewards=False (ART's older name).")
    adam_params: None = _refused(None, "set TrainerConfig(adam_beta1, adam_beta2, weight_decay)")
    kl_penalty_coef: float = Field(
        0.0,
        ge=0,
        description="Shift each sampled token's advantage by coef·(mean KL − token KL), KL = new − "
        "reference logprob (ART's KL-penalized advantage); 0 = off.",
    )
    kl_penalty_reference_step: int | None = Field(
        None, ge=0, description="Checkpoint step whose adapter is the KL reference; None = the base model."
    )
    kl_ref_adapter_path: str | None = Field(
        None, description="Adapter folder used as the KL reference (instead of kl_penalty_reference_step)."
    )
    epsilon: float | None = Field(
        None,
        gt=0,
        description="Lower clip: ratios below 1 − epsilon are clipped. None: 1.0 (cispo), 0.2 (ppo).",
    )
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip: 1 + epsilon_high. None: 4.0 (cispo), epsilon (ppo)."
    )
    advantage_balance: float = Field(
        0.0, ge=-1.0, le=1.0, description="> 0 shrinks negative advantages by (1 − b), < 0 positive ones."
    )
    scale_rewards: bool = Field(True, description="Divide advantages by the group's reward std (+1e-6).")
    importance_sampling_level: ImportanceSamplingLevel = Field(
        "token", description="Importance ratio per token, per sequence (exp of the mean log-ratio), or both."
    )
    max_negative_advantage_importance_sampling_weight: float | None = Field(
        None, gt=0, description="Upper bound on every importance ratio (as ART applies it)."
    )
    mask_prob_ratio: bool = Field(False, description="Zero the ratio (and gradient) outside the clip range.")
    kimi_k2_tau: float | None = Field(None, description="Advantage -= tau · (new − old logprob).")
    precalculate_logprobs: bool = Field(
        False,
        description="Score the batch with the policy before the step and use that as the old logprobs; "
        "the sampler's logprobs then only enter truncated_importance_sampling.",
    )
    allow_training_without_logprobs: bool = Field(
        False, description="Train Choices without sampler logprobs (ratio 1 for their tokens)."
    )
    train_unconstrained: bool = Field(
        False,
        description="Train Choices whose sampling constraint the trainer cannot reproduce (a grammar, or "
        "a constrained Choice without token_ids) as if unconstrained; False refuses them.",
    )
    plot_tensors: bool = _refused(False, "see the metrics in TrainResult and history.jsonl")
    truncated_importance_sampling: float | None = Field(
        None, gt=0, description="Multiply each token's loss by min(ratio, this), detached."
    )
    scale_learning_rate_by_reward_std_dev: bool = _refused(
        False, "ART 0.5.18's LocalBackend ignores it too; scale learning_rate per step yourself"
    )
    logprob_calculation_chunk_size: int = Field(
        1024, ge=1, description="Accepted; no effect: the trainer upcasts only the sampled tokens' logits."
    )
    packed_sequence_length: int | None = Field(
        None,
        ge=16,
        description="Length of a packed row (one optimizer step each); None: the longest sequence rounded "
        "up to a multiple of 2048, at most TrainerConfig.max_seq_length. Longer sequences are dropped.",
    )
    num_trajectories_learning_rate_multiplier_power: float = Field(
        0.0, description="Each row's learning rate × (sequences in the row) ** power."
    )
    save_checkpoint: bool = Field(
        True,
        description="As ART: the checkpoint is written either way (the server loads it); False only "
        "leaves TrainResult.checkpoint_path None.",
    )
    verbose: bool = Field(False, description="Log the step's metrics; show a progress bar.")
    max_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Gradient clipping for this step (not an ART keyword); None = TrainerConfig's.",
    )

    @model_validator(mode="before")
    @classmethod
    def _check_refused(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for name, value in values.items():
                info = cls.model_fields.get(name)
                extra = info.json_schema_extra if info is not None else None
                if isinstance(extra, dict) and _REFUSED in extra and value != info.default:
                    raise ValueError(
                        f"{name}={value!r} is not supported by SGLangBackend (only ART's default "
                        f"{info.default!r} is accepted): {extra[_REFUSED]}"
                    )
        return values

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainOptions:
        if self.kl_penalty_reference_step is not None and self.kl_ref_adapter_path is not None:
            raise ValueError("give kl_penalty_reference_step or kl_ref_adapter_path, not both")
        if self.kimi_k2_tau is not None and not math.isfinite(self.kimi_k2_tau):
            raise ValueError("kimi_k2_tau must be finite")
        return self

    # --- derived values --------------------------------------------------------------------------------
    @property
    def clip(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) after ART's per-loss defaults."""
        epsilon_default, high_default = EPSILON_DEFAULTS[self.loss_fn]
        epsilon = self.epsilon if self.epsilon is not None else epsilon_default
        high = self.epsilon_high if self.epsilon_high is not None else high_default
        return epsilon, high if high is not None else epsilon

    @property
    def scales_rewards(self) -> bool:
        return self.scale_rewards and self.normalize_advantages

    def input_rules(self) -> dict[str, bool]:
        """The keywords of `validate_groups` these options set."""
        return {
            "allow_training_without_logprobs": self.allow_training_without_logprobs,
            "train_unconstrained": self.train_unconstrained,
        }

    @classmethod
    def from_keywords(cls, options: dict[str, Any]) -> TrainOptions:
        """Validate `train()` keywords; `ConfigError` names each bad option and the fix."""
        unknown = sorted(set(options) - set(cls.model_fields))
        if unknown:
            raise ConfigError(
                f"train() got unknown option(s) {unknown}; SGLangBackend.train takes "
                f"{', '.join(cls.model_fields)}"
            )
        try:
            return cls(**options)
        except ValidationError as exc:
            problems = "; ".join(_describe(e) for e in exc.errors())
            raise ConfigError(f"invalid train() option: {problems}") from None

    @classmethod
    def from_dev_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Keywords from an ART `dev.TrainConfig` dict (older `model.train(..., _config=...)`): the same
        names, except `ppo: bool`, which selects loss_fn."""
        keywords = dict(config)
        if "ppo" in keywords:
            keywords["loss_fn"] = "ppo" if keywords.pop("ppo") else "cispo"
        return keywords

    @classmethod
    def signature(cls, head: inspect.Signature) -> inspect.Signature:
        """`head`'s positional parameters followed by every option as a keyword with its default (for
        `help(backend.train)` and editors that read `__signature__`)."""
        keywords = [
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=info.default, annotation=info.annotation
            )
            for name, info in cls.model_fields.items()
        ]
        positional = [p for p in head.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        return head.replace(parameters=[*positional, *keywords])


def _describe(error: Any) -> str:
    location = ".".join(str(p) for p in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if not location:
        return message
    return f"{location}={error.get('input')!r}: {message}"


@dataclass
class StepOutcome:
    """The result of one `train()` call. The step always advances by one (as ART: a batch without any
    learning signal still gets a new checkpoint, a copy of the last). `trained=False` means no optimizer
    step was taken and `reason` says why; the metrics still count what was seen and skipped."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    trained: bool = True
    reason: str | None = None
