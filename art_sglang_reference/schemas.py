"""Request bodies of the HTTP subset, with SGLang's field names and defaults. Unknown fields are accepted
(OpenAI clients send many) and ignored."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from art_sglang.serving.choice_count import ChoiceCount


def string_list(value: str | list[str] | None) -> list[str]:
    """`stop` / `stop_regex` as a list: SGLang takes one string or several."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Sampling fields shared by chat and text completions (SGLang's extensions included)."""

    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: ChoiceCount = 1
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    lora_path: str | None = None
    return_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value: int | None) -> int | None:
        # SGLang 0.5.17 refuses 0 here too (chat allows 0): same check, same words.
        if value is not None and value <= 0:
            raise ValueError("max_tokens must be positive")
        return value


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None  # a list: one per prompt
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None


class LoadLoRARequest(_Body):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRARequest(_Body):
    lora_name: str


class MemoryOccupationRequest(_Body):
    tags: list[str] | None = None


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_Body):
    # One entry per tensor-parallel rank (this engine has one); HTTP carries them as base64, which SGLang
    # decodes while validating the body, so text that is not base64 is a 400.
    serialized_named_tensors: list[bytes] = Field(min_length=1)
    load_format: Literal["flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    @field_validator("serialized_named_tensors", mode="before")
    @classmethod
    def _base64(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        try:
            return [
                base64.b64decode(item, validate=True) if isinstance(item, str) else item for item in value
            ]
        except (binascii.Error, ValueError) as exc:
            raise ValueError("Expected base64-encoded bytes") from exc


class InitWeightsUpdateGroupRequest(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None


class PauseGenerationRequest(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(_Body):
    torch_empty_cache: bool = True  # CUDA's allocator cache; nothing to do on CPU


class UpdateWeightVersionRequest(_Body):
    new_version: str
    abort_all_requests: bool = True
