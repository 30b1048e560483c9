"""The reference engine's base weights as SGLang handles them: named as in the checkpoint, read from a
local directory and checked against the served model's shapes, and the memory tags of
/release_memory_occupation and /resume_memory_occupation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from art_sglang.serving.sglang_api import MEMORY_TAGS


class WeightsLoadError(ValueError):
    """New base weights could not be read or do not fit the served model."""


def weight_params(base: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The base model's parameters under their checkpoint names (peft's wrappers and LoRA removed)."""
    params = {}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        params[name.replace(".base_layer", "")] = param
    return params


def read_weights(path: str, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` by parameter name; WeightsLoadError unless it has every name of `shapes`
    with that shape."""
    if not Path(path).is_dir():
        raise WeightsLoadError(
            f"Failed to get weights iterator: model path {path!r} does not exist or is not a directory "
            "(the reference engine reads weights from local directories only)."
        )
    try:
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for an unreadable checkpoint
        raise WeightsLoadError(f"Failed to load weights from {path!r}: {exc}") from exc
    weights = dict(fresh.state_dict())
    missing = sorted(set(shapes) - set(weights))
    mismatched = [n for n, s in shapes.items() if n in weights and weights[n].shape != s]
    if missing or mismatched:
        raise WeightsLoadError(
            f"Weights at {path!r} do not fit the served model: missing {missing[:5]}, "
            f"different shapes {mismatched[:5]}."
        )
    return weights


def assign_weights(base: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, param in weight_params(base).items():
        param.data = weights[name].to(torch.float32)


def memory_tags(tags: Sequence[str] | None) -> set[str]:
    """SGLang's reading of `tags`: none or empty means every kind of memory; an unknown tag is an error."""
    wanted = set(tags or MEMORY_TAGS)
    unknown = wanted - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
    return wanted
