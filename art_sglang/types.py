"""Message aliases and small result/config types, named as in OpenPipe ART 0.5.x.

Messages are the `openai` package's own types: a prompt message is a `ChatCompletionMessageParam` dict, a
sampled completion is a `Choice` (it carries the logprobs the trainer needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam
from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, SkipValidation, Tag

__all__ = [
    "Choice",
    "LocalTrainResult",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
]

# Messages are TypedDicts; validating them would reject the many shapes the OpenAI API accepts.
Message = Annotated[ChatCompletionMessageParam, SkipValidation]


def _message_or_choice(value: Any) -> str:
    # A dumped Choice has `message` and `finish_reason`; a message has `role`. Without this discriminator
    # a Choice read back from JSON would stay a plain dict and lose its place as a trainable completion.
    if isinstance(value, Choice):
        return "choice"
    if isinstance(value, dict) and "message" in value and "finish_reason" in value:
        return "choice"
    return "message"


MessageOrChoice = Annotated[
    Annotated[Message, Tag("message")] | Annotated[Choice, Tag("choice")],
    Discriminator(_message_or_choice),
]
Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[ChatCompletionToolParam]


class TrainConfig(BaseModel):
    """Options of `model.train(groups, config=TrainConfig(...))`, the style of older ART releases."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    learning_rate: float = Field(5e-6, gt=0)
    # Older ART called the KL coefficient `beta`.
    kl_penalty_coef: float = Field(0.0, ge=0, validation_alias=AliasChoices("kl_penalty_coef", "beta"))


class TrainSFTConfig(BaseModel):
    """Options of `model.train_sft(trajectories, config=TrainSFTConfig(...))`, as ART's: one learning rate
    for every batch or one per batch, and the trajectories per batch ("auto" = 2, ART's default)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | list[float] = 5e-5
    batch_size: int | Literal["auto"] = "auto"


@dataclass
class TrainResult:
    """What a backend's `train()` returns: the step reached and the aggregated training metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LocalTrainResult(TrainResult):
    """What `SGLangBackend.train()` returns, as ART's `LocalBackend.train()`: also the new checkpoint's
    folder, None with `save_checkpoint=False`."""

    checkpoint_path: str | None = None
