"""ART's `TrainableModel(_internal_config=art.dev.InternalModelConfig(...))` read into this backend's
settings: every key with an equivalent changes the trainer, the server or the device layout; every other
key raises `ConfigError` naming it and what to use instead. Nothing is ignored.

The keys are ART 0.5.18's (`art/dev/model.py`): `init_args` (Unsloth loading), `peft_args` (the LoRA),
`trainer_args` (TRL's trainer settings), `engine_args` (vLLM's), `chat_template*`, `*_gpu_ids`,
`rollout_weights_mode`, `tinker*`, `allow_unvalidated_arch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..config import SGLangConfig, TrainerConfig
from ..errors import ConfigError

# What a key maps to: (TrainerConfig updates, SGLangConfig updates) for its value.
Mapper = Callable[[Any], tuple[dict[str, Any], dict[str, Any]]]


def _trainer(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapper:
    return lambda value: ({name: convert(value)}, {})


def _server(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapper:
    return lambda value: ({}, {name: convert(value)})


def _only(accepted: tuple[Any, ...], advice: str) -> Callable[[str, Any], None]:
    """A key this backend implements one way: values that ask for that way are accepted."""

    def check(key: str, value: Any) -> None:
        if value not in accepted:
            raise ConfigError(f"_internal_config {key}={value!r} is not supported by SGLangBackend: {advice}")

    return check


def _checkpointing(value: Any) -> bool:
    # Unsloth and TRL spell "on" as True or "unsloth".
    return value not in (False, None, "false", "False")


INIT_ARGS: dict[str, Mapper] = {
    "max_seq_length": _trainer("max_seq_length"),
    "load_in_4bit": _trainer("load_in_4bit", bool),
    "dtype": _trainer("dtype", lambda v: "auto" if v is None else str(v).replace("torch.", "")),
    "random_state": _trainer("seed"),
    "use_gradient_checkpointing": _trainer("gradient_checkpointing", _checkpointing),
}
PEFT_ARGS: dict[str, Mapper] = {
    "r": _trainer("lora_rank"),
    "lora_alpha": _trainer("lora_alpha"),
    "lora_dropout": _trainer("lora_dropout", float),
    "target_modules": _trainer("target_modules", list),
    "random_state": _trainer("seed"),
    "use_gradient_checkpointing": _trainer("gradient_checkpointing", _checkpointing),
    "max_seq_length": _trainer("max_seq_length"),
}
TRAINER_ARGS: dict[str, Mapper] = {
    "weight_decay": _trainer("weight_decay", float),
    "adam_beta1": _trainer("adam_beta1", float),
    "adam_beta2": _trainer("adam_beta2", float),
    "adam_epsilon": _trainer("adam_epsilon", float),
    "max_grad_norm": _trainer("max_grad_norm", float),
    "gradient_checkpointing": _trainer("gradient_checkpointing", _checkpointing),
    "seed": _trainer("seed"),
}
ENGINE_ARGS: dict[str, Mapper] = {
    "gpu_memory_utilization": _server("mem_fraction_static", float),
    "max_model_len": _server("context_length"),
    "tensor_parallel_size": _server("tensor_parallel_size"),
    "max_lora_rank": _server("max_lora_rank"),
    "max_loras": _server("max_loras_per_batch"),
    "enable_prefix_caching": _server("disable_radix_cache", lambda v: not v),
    "lora_target_modules": _server("lora_target_modules", list),
}

# Keys with one accepted value (what this backend does), and the advice for any other.
FIXED: dict[tuple[str, str], Callable[[str, Any], None]] = {
    ("init_args", "load_in_8bit"): _only((False,), "use load_in_4bit, or neither"),
    ("init_args", "load_in_16bit"): _only((True, False), ""),
    ("init_args", "full_finetuning"): _only((False,), "this backend trains LoRA adapters only"),
    ("init_args", "fast_inference"): _only((), "ART removed it too; inference runs on the SGLang server"),
    ("peft_args", "bias"): _only(("none",), "adapters train LoRA A/B only (SGLang serves no LoRA bias)"),
    ("peft_args", "use_rslora"): _only((False,), "SGLang scales adapters by lora_alpha / r"),
    ("peft_args", "modules_to_save"): _only((None, []), "SGLang serves LoRA A/B weights only"),
    ("peft_args", "layers_to_transform"): _only((None,), "adapters cover every layer"),
    ("trainer_args", "optim"): _only(
        ("adamw_torch", "adamw_torch_fused"),
        "the trainer runs torch AdamW in 32 bit; tune it with adam_beta1/adam_beta2/adam_epsilon/weight_decay",
    ),
    ("trainer_args", "learning_rate"): _only((), "pass learning_rate to train() for each step"),
    ("trainer_args", "lr_scheduler_type"): _only(
        ("constant",), "pass each step's learning_rate to train() (a schedule is a list of rates)"
    ),
    ("trainer_args", "gradient_accumulation_steps"): _only(
        (1,), "one train() call is one optimizer step; TrainerConfig(micro_batch_tokens=...) sets the memory"
    ),
    ("trainer_args", "report_to"): _only(("none", None, []), "metrics go to history.jsonl and TrainResult"),
    ("trainer_args", "save_strategy"): _only(("no",), "the backend writes one checkpoint per step"),
    ("trainer_args", "logging_steps"): _only((1,), "every step is logged"),
    ("trainer_args", "disable_tqdm"): _only((True, False), ""),
    ("engine_args", "model"): _only((), "the model is TrainableModel.base_model"),
    ("engine_args", "enable_lora"): _only((True,), "every step is served as a LoRA adapter"),
}
_SECTIONS: dict[str, dict[str, Mapper]] = {
    "init_args": INIT_ARGS,
    "peft_args": PEFT_ARGS,
    "trainer_args": TRAINER_ARGS,
    "engine_args": ENGINE_ARGS,
}
_SECTION_ADVICE = {
    "init_args": "set it through TrainerConfig",
    "peft_args": "set the LoRA through TrainerConfig(lora_rank, lora_alpha, lora_dropout, target_modules)",
    "trainer_args": "set optimizer settings through TrainerConfig",
    "engine_args": "pass SGLang flags through SGLangConfig (extra_args for any flag it does not name)",
}


@dataclass(frozen=True)
class ModelSettings:
    """What one model's `_internal_config` asks of the backend."""

    trainer: TrainerConfig
    server_updates: dict[str, Any] = field(default_factory=dict)  # SGLangConfig fields
    chat_template: str | None = None  # template text, for the server and the trainer alike
    chat_template_path: str | None = None  # a file the server can read directly
    inference_gpu_ids: list[int] | None = None
    trainer_gpu_ids: list[int] | None = None

    @property
    def template_text(self) -> str | None:
        """The chat template the server reads from a file this backend writes (given as text only)."""
        return self.chat_template if self.chat_template_path is None else None


def model_settings(internal: Mapping[str, Any] | None, trainer: TrainerConfig) -> ModelSettings:
    """The trainer config and server settings `internal` asks for, on top of the backend's own."""
    internal = dict(internal or {})
    trainer_updates: dict[str, Any] = {}
    server_updates: dict[str, Any] = {}
    for section, mappers in _SECTIONS.items():
        values = internal.pop(section, None) or {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"_internal_config {section} must be a dict, got {type(values).__name__}")
        for key, value in values.items():
            if (section, key) in FIXED:
                FIXED[(section, key)](f"{section}.{key}", value)
            elif key in mappers:
                for_trainer, for_server = mappers[key](value)
                trainer_updates.update(for_trainer)
                server_updates.update(for_server)
            else:
                raise ConfigError(
                    f"_internal_config {section}.{key} has no equivalent in SGLangBackend: "
                    f"{_SECTION_ADVICE[section]}; supported keys: {', '.join(sorted(mappers))}"
                )
    template_text, template_path = _chat_template(
        internal.pop("chat_template", None), internal.pop("chat_template_path", None)
    )
    if template_text is not None:
        trainer_updates["chat_template"] = template_text
    kwargs = internal.pop("chat_template_kwargs", None)
    if kwargs is not None:
        trainer_updates["chat_template_kwargs"] = dict(kwargs)
    for key, accepted, advice in (
        ("chat_template_content_format", ("auto", "string"), "the server renders message content as given"),
        ("chat_template_tool_schema_format", ("default",), "tools are rendered as the request sends them"),
        ("tinker_args", (None,), "this backend trains locally"),
        ("tinker_native_args", (None,), "this backend trains locally"),
        ("allow_unvalidated_arch", (True, False), ""),
    ):
        if key in internal:
            _only(accepted, advice)(key, internal.pop(key))
    # ART's merged rollouts (vLLM serving the trainer's merged weights) are this backend's merged mode.
    mode = internal.pop("rollout_weights_mode", "lora")
    if mode == "merged":
        server_updates["weight_sync_method"] = "merged"
    elif mode != "lora":
        raise ConfigError(
            f"_internal_config rollout_weights_mode={mode!r}: ART's modes are 'lora' and 'merged'"
        )
    inference_ids = internal.pop("inference_gpu_ids", None)
    trainer_ids = internal.pop("trainer_gpu_ids", None)
    if (inference_ids is None) != (trainer_ids is None):
        raise ConfigError(
            "_internal_config trainer_gpu_ids and inference_gpu_ids must both be set or both unset"
        )
    if internal:
        raise ConfigError(f"_internal_config key(s) {sorted(internal)} are unknown to SGLangBackend")
    try:
        merged = TrainerConfig.model_validate({**trainer.model_dump(), **trainer_updates})
        SGLangConfig.model_validate(server_updates)  # types and ranges, before anything starts
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"_internal_config: {problems}") from None
    return ModelSettings(
        trainer=merged,
        server_updates=server_updates,
        chat_template=template_text,
        chat_template_path=template_path,
        inference_gpu_ids=list(inference_ids) if inference_ids is not None else None,
        trainer_gpu_ids=list(trainer_ids) if trainer_ids is not None else None,
    )


def _chat_template(text: str | None, path: str | None) -> tuple[str | None, str | None]:
    """(template text, file path or None): ART reads either a template or a template file."""
    if text is not None and path is not None:
        raise ConfigError("_internal_config: set only one of chat_template or chat_template_path")
    if path is None:
        return text, None
    try:
        return Path(path).read_text(encoding="utf-8"), str(Path(path).resolve())
    except OSError as exc:
        raise ConfigError(f"_internal_config chat_template_path={path!r} cannot be read: {exc}") from None


def internal_config_of(model: Any) -> Mapping[str, Any] | None:
    """The model's `_internal_config` (ART's and ours keep it in the same private attribute)."""
    return getattr(model, "_internal_config", None)
