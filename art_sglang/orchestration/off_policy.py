"""How far off-policy a rollout served by merged weights may be (ART's `max_steps_off_policy`): every choice
the gateway answered on merged weights carries the weight versions that sampled its tokens
(`art_weight_versions`, serving/gateway/resend.py), and train() refuses a group whose tokens were sampled
by weights more than `SGLangConfig.max_steps_off_policy` steps (0 when unset) behind the step it trains
from. The tokens' logprobs are those each version sampled them with (the choice carries them per token),
so the importance ratios of a rollout that spans an update are right; the bound keeps them near 1."""

from __future__ import annotations

from ..errors import TrainingInputError
from ..serving.gateway.resend import VERSIONS_FIELD
from ..serving.served_names import parse_served_name
from ..training.validation import CheckedGroups, histories, is_choice


def check_off_policy(groups: CheckedGroups, model: str, step: int, max_steps_off_policy: int | None) -> None:
    """Raise `TrainingInputError` naming the first trajectory of `groups` with a token sampled by `model`'s
    weights of a step more than `max_steps_off_policy` (None: 0) before `step`."""
    bound = max_steps_off_policy or 0
    for g, group in enumerate(groups.wire):
        for t, trajectory in enumerate(group.get("trajectories") or []):
            for items, _ in histories(trajectory):
                for choice in filter(is_choice, items):
                    oldest = _oldest_step(choice.get(VERSIONS_FIELD), model)
                    if oldest is not None and step - oldest > bound:
                        raise TrainingInputError(
                            f"group {g}, trajectory {t}: tokens sampled by `{model}@{oldest}`, "
                            f"{step - oldest} steps behind step {step} that this call trains from, more "
                            f"than max_steps_off_policy={bound} allows (set "
                            "SGLangConfig(max_steps_off_policy=N); ART's PipelineTrainer drops groups that "
                            "are older than its own bound)"
                        )


def _oldest_step(spans: object, model: str) -> int | None:
    """The oldest step of `model` among a choice's version spans (those with tokens); None without any."""
    steps = []
    for span in spans if isinstance(spans, list) else []:
        parsed = parse_served_name(str(span.get("version"))) if isinstance(span, dict) else None
        if parsed is not None and parsed[0] == model and span.get("tokens"):
            steps.append(parsed[1])
    return min(steps, default=None)
