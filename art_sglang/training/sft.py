"""Supervised fine-tuning, as ART's `model.train_sft`: the trajectories' assistant turns are the targets.

- Batches of `batch_size` trajectories (ART's default 2), each with its learning rate; one AdamW step
  per batch on the mean cross-entropy over the batch's target tokens, gradients clipped to norm 1.0,
  no weight decay (ART's SFT settings). One `train_sft` call is one new step: one checkpoint at the end.
- Targets are tokenized exactly as the chat template renders the conversation (tools and tool calls
  included), with the same rule as RL training (tokenize.py): every assistant message or Choice is
  trained on its content and its end-of-turn token; system, user and tool messages and template tokens
  are context. Sampler token ids and logprobs play no part.
- A trajectory longer than `max_seq_length` is dropped and counted, as ART does; a trajectory without
  any assistant turn is a TrainingInputError (it has nothing to learn).
- With several ranks each forwards its share of a batch's sequences and the ranks sum their gradients
  (ranks.py), as in RL training.

The parent imports the batching and validation here; the training itself (`run_sft`) runs in the worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, TrainingInputError
from .validation import WireGroup, is_choice

if TYPE_CHECKING:
    from .tokenize import ChatTokenizer
    from .train_state import TrainState

DEFAULT_BATCH_SIZE = 2  # ART LocalBackend's "auto"
MAX_GRAD_NORM = 1.0
GRADIENT_STEPS = "data/step_num_gradient_steps"


@dataclass
class SFTBatch:
    trajectories: list[WireGroup]
    learning_rate: float


def sft_batches(
    trajectories: Sequence[WireGroup], learning_rate: float | Sequence[float], batch_size: int | str
) -> list[SFTBatch]:
    """Split into batches, each with its learning rate (one for all, or one per batch as ART's)."""
    size = DEFAULT_BATCH_SIZE if batch_size == "auto" else int(batch_size)
    if size < 1:
        raise ConfigError(f"TrainSFTConfig(batch_size={batch_size!r}): use a positive number or 'auto'")
    chunks = [list(trajectories[i : i + size]) for i in range(0, len(trajectories), size)]
    if isinstance(learning_rate, (int, float)):
        rates = [float(learning_rate)] * len(chunks)
    else:
        rates = [float(rate) for rate in learning_rate]
        if len(rates) < len(chunks):
            raise ConfigError(
                f"TrainSFTConfig(learning_rate=[...]) lists {len(rates)} rates for {len(chunks)} batches of "
                f"{size}: give one rate per batch, or a single rate"
            )
    for rate in rates:
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"TrainSFTConfig: learning rate {rate!r} must be a positive number")
    return [SFTBatch(chunk, rate) for chunk, rate in zip(chunks, rates, strict=False)]


def prepare_sft(
    trajectories: Sequence[WireGroup], config: Any, dev_config: dict[str, Any] | None = None
) -> list[SFTBatch]:
    """A `train_sft` call's batches, checked before anything starts: `config` is ART's or our
    `TrainSFTConfig`; ART's experimental `_config` has no options, so any key is refused."""
    if dev_config:
        raise ConfigError(f"train_sft(_config={dict(dev_config)!r}): ART's dev TrainSFTConfig has no options")
    validate_sft(trajectories)
    return sft_batches(trajectories, config.learning_rate, config.batch_size)


def validate_sft(trajectories: Iterable[WireGroup]) -> None:
    """Every trajectory must have an assistant turn to learn; raises TrainingInputError naming the first
    that has none."""
    count = 0
    for index, trajectory in enumerate(trajectories):
        count += 1
        if not any(_is_assistant(item) for item in trajectory.get("messages_and_choices") or []):
            raise TrainingInputError(
                f"SFT trajectory {index} has no assistant message or Choice: there is nothing to train on"
            )
    if count == 0:
        raise TrainingInputError("train_sft() got no trajectories")


def _is_assistant(item: Any) -> bool:
    return is_choice(item) or (isinstance(item, dict) and item.get("role") == "assistant")


def as_target(trajectory: WireGroup) -> WireGroup:
    """The trajectory with every assistant turn as a trainable completion of the rendered text: a plain
    message becomes a stopped choice; a Choice loses its sampler ids and logprobs (SFT trains on the
    text as the template renders it)."""
    items = []
    for item in trajectory.get("messages_and_choices") or []:
        if is_choice(item):
            items.append({"message": item["message"], "finish_reason": "stop"})
        elif _is_assistant(item):
            items.append({"message": item, "finish_reason": "stop"})
        else:
            items.append(item)
    return {"messages_and_choices": items, "tools": trajectory.get("tools")}


def run_sft(
    state: TrainState,
    chat: ChatTokenizer,
    batches: list[SFTBatch],
    progress: Callable[[dict[str, Any]], None],
) -> dict[str, float]:
    """Train the batches (one optimizer step each on `state`, tokenized by `chat`), reporting each batch's
    metrics through `progress`; returns the call's summary."""
    import torch

    from .loss import sampled_token_logprobs
    from .tokenize import TokenizeStats

    stats = TokenizeStats()
    prepared: list[tuple[list[Any], int, float]] = []  # (sequences, dropped trajectories, rate)
    for index, batch in enumerate(batches):
        sequences, dropped = [], 0
        for position, trajectory in enumerate(batch.trajectories):
            tokenized = chat.tokenize_trajectory(
                as_target(trajectory), group=index, index=position, stats=stats
            )
            if any(len(s.input_ids) > state.config.max_seq_length for s in tokenized):
                dropped += 1
                continue
            sequences += [s for s in tokenized if s.num_sampled > 0]
        prepared.append((sequences, dropped, batch.learning_rate))
    total_tokens = sum(s.num_sampled for sequences, _, _ in prepared for s in sequences)
    dropped_total = sum(dropped for _, dropped, _ in prepared)
    if dropped_total:
        print(
            f"WARNING: dropped {dropped_total} SFT trajectories longer than max_seq_length="
            f"{state.config.max_seq_length}",
            flush=True,
        )
    common = {
        "data/step_num_trajectories": float(sum(len(b.trajectories) for b in batches)),
        "data/step_trainer_tokens": float(total_tokens),
        "data/step_num_dropped_trajectories": float(dropped_total),
        GRADIENT_STEPS: float(len(batches)),
    }
    state.model.train()
    losses = []
    for sequences, _, rate in prepared:
        started = time.perf_counter()
        for group in state.optimizer.param_groups:
            group["lr"] = rate
        batch_tokens = sum(s.num_sampled for s in sequences)
        batch_loss, grad_norm = 0.0, 0.0
        if batch_tokens:
            state.optimizer.zero_grad(set_to_none=True)
            for sequence in state.ranks.share(sequences, lambda s: len(s.input_ids)):
                input_ids = torch.tensor([sequence.input_ids], device=state.device)
                mask = torch.tensor([sequence.sampled_mask], device=state.device)
                logits = state.model(input_ids=input_ids, use_cache=False).logits
                loss = -sampled_token_logprobs(logits, input_ids, mask).sum() / batch_tokens
                loss.backward()
                batch_loss += float(loss.detach())
            (batch_loss,) = state.ranks.sum_gradients(state.params, [batch_loss])
            grad_norm = float(torch.nn.utils.clip_grad_norm_(state.params, MAX_GRAD_NORM))
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        losses.append(batch_loss)
        progress(
            {
                "phase": "sft",
                "metrics": {
                    "loss/train": batch_loss,
                    "loss/learning_rate": rate,
                    "loss/grad_norm": grad_norm,
                    "data/step_tokens_per_second": sum(len(s.input_ids) for s in sequences) / seconds
                    if seconds > 0
                    else 0.0,
                    **common,
                },
            }
        )
    return {"loss/train": sum(losses) / len(losses) if losses else 0.0, **common}
