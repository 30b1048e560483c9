"""Load the base model with a LoRA adapter: Unsloth `FastLanguageModel` when it is wanted and usable,
transformers + peft otherwise. Import this module before anything imports transformers: Unsloth must be
imported first to patch it."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config import TrainerConfig
from ..cpu_threads import limit_threads_for_small_model
from ..errors import TrainerError

Backend = Literal["unsloth", "peft"]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: Any  # a peft PeftModel (Unsloth returns one too)
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    backend: Backend
    gradient_checkpointing: bool


def choose_backend(use_unsloth: bool | Literal["auto"]) -> Backend:
    """'auto': Unsloth when it is installed and CUDA is available; True: Unsloth or a clear error."""
    if use_unsloth is False:
        return "peft"
    installed = importlib.util.find_spec("unsloth") is not None
    if use_unsloth == "auto":
        return "unsloth" if installed and torch.cuda.is_available() else "peft"
    if not torch.cuda.is_available():
        raise TrainerError("use_unsloth=True needs a CUDA GPU, and none is visible to the trainer")
    if not installed:
        raise TrainerError(
            "use_unsloth=True but unsloth is not installed (pip install -e '.[train]' in the art_sglang checkout)"
        )
    return "unsloth"


def resolve_dtype(setting: str, cuda: bool) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return _DTYPES[setting]


def load_model(base_model: str, config: TrainerConfig) -> LoadedModel:
    backend = choose_backend(config.use_unsloth)
    cuda = torch.cuda.is_available()
    dtype = resolve_dtype(config.dtype, cuda)
    checkpointing = config.gradient_checkpointing if config.gradient_checkpointing is not None else cuda
    torch.manual_seed(config.seed)
    if backend == "unsloth":
        model, tokenizer = _load_unsloth(base_model, config, dtype, checkpointing)
    else:
        model, tokenizer = _load_peft(base_model, config, dtype, checkpointing, cuda)
    if not cuda:
        limit_threads_for_small_model(model)
    # The current device is this rank's (ranks.py sets it; Unsloth places the model there too).
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return LoadedModel(model, tokenizer, device, dtype, backend, checkpointing)


def _load_unsloth(
    base_model: str, config: TrainerConfig, dtype: torch.dtype, checkpointing: bool
) -> tuple[Any, Any]:
    # Unsloth drops logits in training forwards unless told to keep them; the loss needs them.
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    from unsloth import FastLanguageModel

    # The whole model on this rank's GPU: Unsloth's default ("sequential") would fill the first visible
    # GPU from every rank.
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=base_model,
        max_seq_length=config.max_seq_length,
        dtype=dtype,
        load_in_4bit=False,
        device_map={"": torch.cuda.current_device()},
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.target_modules),
        bias="none",
        use_gradient_checkpointing="unsloth" if checkpointing else False,
        random_state=config.seed,
    )
    return model, tokenizer


def _load_peft(
    base_model: str, config: TrainerConfig, dtype: torch.dtype, checkpointing: bool, cuda: bool
) -> tuple[Any, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if cuda:
        model = model.cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora), tokenizer
