"""The trainer's policy as merged weights (merged-weight rollouts, docs/merged-rollouts.md): for every
module LoRA wraps, `W + (B @ A) * scaling`, computed out of place in float32 from the base weight `W` and
rounded once to `W`'s dtype. `W` is never written (peft trains only A and B), so the trainer's own base is
the pristine copy, and step N's merged weights carry one rounding however many steps came before — unlike
merging in place and unmerging after (ART's merged mode), which rounds the base twice per step.

The tensors are named as in the checkpoint (peft's `base_model.model.` and `.base_layer` removed), as
SGLang's `load_weights` takes them; modules LoRA does not wrap never change and are not yielded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import TrainerError

_PEFT_PREFIX = "base_model.model."


def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, merged weight) of each LoRA-wrapped module of the peft `model`, one at a time (a
    float32 copy of one weight is the most this holds beside the model). TrainerError where the base
    cannot be merged into: a quantized weight, a DoRA adapter."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            adapters = [name for name in module.active_adapters if name in module.lora_A]
            if not adapters:
                continue
            weight = module.get_base_layer().weight
            if not weight.dtype.is_floating_point:
                raise TrainerError(
                    f"{module_name}: the base weight is {weight.dtype} (quantized); merged weights are the "
                    "base in bf16 plus the adapter, so train with load_in_4bit=False or use "
                    "weight_sync_method='lora'"
                )
            merged = weight.float()
            for name in adapters:
                if module.use_dora.get(name, False):
                    raise TrainerError(f"{module_name}: DoRA adapters cannot be merged here")
                delta = module.lora_B[name].weight.float() @ module.lora_A[name].weight.float()
                merged = merged + (delta.T if module.fan_in_fan_out else delta) * module.scaling[name]
            yield checkpoint_name(module_name) + ".weight", merged.to(weight.dtype)


def checkpoint_name(module_name: str) -> str:
    """A peft module's name as the base checkpoint names it."""
    return module_name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")
