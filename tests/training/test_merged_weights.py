"""The trainer's merged weights (art_sglang/training/merged_weights.py): what peft's merge gives, every
wrapped module and nothing else, rounded once from a base that is never written, and a quantized base
refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from art_sglang.errors import TrainerError
from art_sglang.training.merged_weights import merged_weights, push_merged

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter's size of change
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(5.0)
    return peft_model


def _base(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}


def test_merged_weights_are_peft_merge_of_every_wrapped_module(tiny_model_path: Path) -> None:
    peft_model = _peft_model(tiny_model_path, torch.float32)
    base = _base(peft_model)
    merged = dict(merged_weights(peft_model))
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    layers = peft_model.config.num_hidden_layers
    assert len(merged) == layers * len(TARGETS)
    for name, tensor in merged.items():
        assert name.split(".")[-2] in TARGETS, name
        assert torch.equal(tensor, expected[name]), name
    assert all(torch.equal(p, base[n]) for n, p in _base(peft_model).items())  # the base was not written


def test_bf16_weights_are_rounded_once_from_an_untouched_base(tiny_model_path: Path) -> None:
    peft_model = _peft_model(tiny_model_path, torch.bfloat16)
    base = _base(peft_model)
    for _ in range(3):  # steps: the base stays bit for bit, so every merge is as exact as the first
        merged = dict(merged_weights(peft_model))
    assert all(torch.equal(p, base[n]) for n, p in _base(peft_model).items())
    module = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    truth = (
        module.base_layer.weight.float()
        + (module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float())
        * module.scaling["default"]
    )
    ours = merged["model.layers.0.self_attn.q_proj.weight"]
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, truth.to(torch.bfloat16))


def test_a_quantized_base_is_refused(tiny_model_path: Path) -> None:
    peft_model = _peft_model(tiny_model_path, torch.float32)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    layer.weight = torch.nn.Parameter(torch.zeros(layer.weight.shape, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(TrainerError, match="load_in_4bit=False"):
        list(merged_weights(peft_model))


def test_push_hands_over_bounded_buckets_in_order_and_stops_when_told(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serializing (test_named_tensors.py) is replaced by a note of the bucket: a CPU tensor shared from the
    test process would start torch's shared-memory manager beside it."""
    import art_sglang.training.merged_weights as module

    serialized: list[list[tuple[str, torch.Tensor]]] = []
    formats: set[object] = set()

    def note(bucket: list[tuple[str, torch.Tensor]], load_format: object) -> str:
        serialized.append([(name, tensor.clone()) for name, tensor in bucket])
        formats.add(load_format)
        return str(len(serialized) - 1)

    monkeypatch.setattr(module, "serialize", note)
    peft_model = _peft_model(tiny_model_path, torch.float32)
    merged = list(merged_weights(peft_model))
    bound = sum(t.numel() * t.element_size() for _, t in merged) // 5
    received: list[tuple[str, bool]] = []

    def take(bucket: dict, last: bool, transfer: object) -> bool:
        assert transfer is None  # no group: the payload is all there is
        received.append((bucket["payload"], last))
        return True

    assert push_merged(peft_model, bound, take) == len(received) >= 5
    assert formats == {"flattened_bucket"}
    assert [payload for payload, _ in received] == [str(i) for i in range(len(received))]
    assert [last for _, last in received] == [False] * (len(received) - 1) + [True]
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= bound for b in serialized)
    pushed = [item for bucket in serialized for item in bucket]
    assert [name for name, _ in pushed] == [name for name, _ in merged]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(pushed, merged, strict=True))
    assert push_merged(peft_model, bound, lambda bucket, last, transfer: False, load_format=None) == 0
