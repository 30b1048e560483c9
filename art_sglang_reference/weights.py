"""The reference engine's base weights as SGLang handles them: named as in the checkpoint, replaced from a
local directory or from named tensors (pushed or broadcast) and checked against the served model's shapes,
released and resumed by memory tag, and the version the server reports for them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from art_sglang.serving.sglang_api import MEMORY_TAGS, WEIGHTS_TAG

logger = logging.getLogger(__name__)


class WeightsLoadError(ValueError):
    """New base weights could not be read or do not fit the served model."""


class WeightShapeError(ValueError):
    """A pushed tensor's shape differs from its parameter's (SGLang's loader asserts, in its scheduler)."""


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


class BaseWeights:
    """The served model's base weights: where they are (in place, released, backed up in RAM), the
    directory they came from, the version the server reports, and their replacement. Not thread-safe: the
    engine calls it under its model lock."""

    def __init__(self, base: torch.nn.Module, path: str, *, cpu_backup: bool) -> None:
        self._base = base
        self.path = path
        self.version = "default"  # SGLang's weight version until an update names one
        self._cpu_backup = cpu_backup
        self.released: set[str] = set()  # memory tags released ("kv_cache", "weights")
        self._backup: dict[str, torch.Tensor] | None = None
        # Shapes the served model needs, checked against new weights (also while released).
        self._shapes = {n: p.shape for n, p in weight_params(base).items()}

    def load_directory(self, path: str) -> None:
        """Replace every weight with the checkpoint at `path` (WeightsLoadError: nothing changed)."""
        weights = read_weights(path, self._shapes)
        if WEIGHTS_TAG in self.released:
            # Resume will restore these instead of the old ones.
            self._backup = weights if self._cpu_backup else None
        else:
            assign_weights(self._base, weights)
        self.path = path

    def load_tensors(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """SGLang's `load_weights` for pushed tensors: each known name copied into its parameter in order,
        an unknown name skipped with a warning, a shape that differs raises WeightShapeError after the
        tensors before it were copied (SGLang keeps no copy to roll back to)."""
        if WEIGHTS_TAG in self.released:
            raise WeightsLoadError("The weights are released; resume the 'weights' tag before pushing.")
        params = weight_params(self._base)
        for name, tensor in named:
            param = params.get(name)
            if param is None:
                logger.warning("Parameter %s not found in params_dict", name)
                continue
            if param.shape != tensor.shape:
                raise WeightShapeError(
                    f"Attempted to load weight ({tensor.shape}) into parameter ({param.shape})"
                )
            with torch.no_grad():
                param.data.copy_(tensor)

    def release(self, tags: set[str]) -> set[str]:
        """Release `tags`; returns those not released before. Released weights are dropped — kept in RAM
        with --enable-weights-cpu-backup (on CPU the backup is the weights themselves), else re-read from
        disk on resume."""
        fresh = tags - self.released
        if WEIGHTS_TAG in fresh:
            params = weight_params(self._base)
            self._backup = {n: p.data for n, p in params.items()} if self._cpu_backup else None
            for param in params.values():
                param.data = torch.empty(0, dtype=param.dtype)
        self.released |= fresh
        return fresh

    def resume(self, tags: set[str]) -> None:
        """Take back `tags`: weights from the backup, else from disk."""
        if WEIGHTS_TAG in tags & self.released:
            weights = self._backup if self._backup is not None else read_weights(self.path, self._shapes)
            assign_weights(self._base, weights)
            self._backup = None
        self.released -= tags

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in weight_params(self._base).values())
