"""The trainer's policy as merged weights (merged-weight rollouts, docs/merged-rollouts.md): for every
module LoRA wraps, `W + (B @ A) * scaling`, computed out of place in float32 from the base weight `W` and
rounded once to `W`'s dtype. `W` is never written (peft trains only A and B), so the trainer's own base is
the pristine copy, and step N's merged weights carry one rounding however many steps came before — unlike
merging in place and unmerging after (ART's merged mode), which rounds the base twice per step.

The tensors are named as in the checkpoint (peft's `base_model.model.` and `.base_layer` removed), as
SGLang's `load_weights` takes them; modules LoRA does not wrap never change and are not yielded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import weight_group
from ..errors import TrainerError
from ..named_tensors import FLATTENED_BUCKET, LoadFormat, buckets, describe, flatten, serialize

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


def push_merged(
    model: Any,
    max_bytes: int,
    send: Callable[[dict[str, Any], bool, Callable[[], None] | None], bool],
    *,
    load_format: LoadFormat = FLATTENED_BUCKET,
    group: Any = None,
) -> int:
    """Hand the merged weights of `model` over bucket by bucket: `send(bucket, last, transfer)` announces
    each bucket, runs `transfer` (if not None) and returns once the servers answered (True: go on). The
    bucket is `{"payload": ...}`, the serialized tensors (CUDA IPC handles, or shared memory on CPU), or,
    with `group` (a weight-update group of which this process is rank 0, weight_group.py), what the
    broadcast carries (`named_tensors.describe`), and `transfer` broadcasts it. The bucket being sent and
    the next one (to know which is last) are the only ones alive. Returns the buckets sent; fewer than all
    when `send` said stop."""
    parts = buckets(merged_weights(model), max_bytes)
    current = next(parts, None)
    sent = 0
    while current is not None:
        following = next(parts, None)
        last = following is None
        # The payload names shared memory (or a CUDA IPC handle): `current` stays alive until `send` returns.
        if group is None:
            go_on = send({"payload": serialize(current, load_format)}, last, None)
        else:
            flat = flatten(current)["flattened_tensor"]
            go_on = send(describe(current), last, lambda flat=flat: weight_group.broadcast(group, flat))
        if not go_on:
            return sent
        sent += 1
        current = following
    return sent


def checkpoint_name(module_name: str) -> str:
    """A peft module's name as the base checkpoint names it."""
    return module_name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")
