"""The trainer's merged weights (art_sglang/training/merged_weights.py): what peft's merge gives, every
wrapped module and nothing else, rounded once from a base that is never written, and a quantized base
refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from art_sglang.errors import TrainerError
from art_sglang.training.merged_weights import merged_weights

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
