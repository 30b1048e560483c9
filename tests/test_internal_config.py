"""ART's `_internal_config` read into this backend's settings: keys with an equivalent are mapped, every
other key is a ConfigError naming it and what to use instead. Checked at register, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_sglang as art
from art_sglang.config import TrainerConfig
from art_sglang.errors import ConfigError
from art_sglang.planning.internal_config import model_settings


def test_keys_with_an_equivalent_are_mapped(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    settings = model_settings(
        {
            "peft_args": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj"]},
            "init_args": {"max_seq_length": 2048, "load_in_4bit": True, "random_state": 7},
            "trainer_args": {
                "weight_decay": 0.01,
                "adam_beta2": 0.95,
                "max_grad_norm": 1.0,
                "optim": "adamw_torch",
            },
            "engine_args": {
                "gpu_memory_utilization": 0.6,
                "max_model_len": 4096,
                "enable_prefix_caching": False,
            },
            "chat_template_path": str(template),
            "chat_template_kwargs": {"enable_thinking": False},
            "trainer_gpu_ids": [1],
            "inference_gpu_ids": [0],
            "rollout_weights_mode": "lora",
        },
        TrainerConfig(),
    )
    trainer = settings.trainer
    assert (trainer.lora_rank, trainer.lora_alpha, trainer.lora_dropout, trainer.target_modules) == (
        16,
        32,
        0.05,
        ["q_proj"],
    )
    assert (trainer.max_seq_length, trainer.load_in_4bit, trainer.seed) == (2048, True, 7)
    assert (trainer.weight_decay, trainer.adam_beta2, trainer.max_grad_norm) == (0.01, 0.95, 1.0)
    assert trainer.chat_template == "{{ messages }}" and trainer.chat_template_kwargs == {
        "enable_thinking": False
    }
    assert settings.server_updates == {
        "mem_fraction_static": 0.6,
        "context_length": 4096,
        "disable_radix_cache": True,
    }
    assert settings.chat_template_path == str(template.resolve())
    assert (settings.inference_gpu_ids, settings.trainer_gpu_ids) == ([0], [1])


@pytest.mark.parametrize(
    ("internal", "match"),
    [
        ({"peft_args": {"use_dora": True}}, r"peft_args\.use_dora has no equivalent.*TrainerConfig"),
        ({"peft_args": {"bias": "all"}}, r"peft_args\.bias='all'.*LoRA A/B only"),
        ({"init_args": {"load_in_8bit": True}}, r"init_args\.load_in_8bit=True"),
        ({"trainer_args": {"optim": "paged_adamw_8bit"}}, r"optim='paged_adamw_8bit'.*32 bit"),
        ({"trainer_args": {"learning_rate": 1e-4}}, r"learning_rate.*pass learning_rate to train\(\)"),
        ({"trainer_args": {"num_train_epochs": 3}}, r"trainer_args\.num_train_epochs has no equivalent"),
        ({"engine_args": {"swap_space": 4}}, r"engine_args\.swap_space.*SGLangConfig \(extra_args"),
        (
            {"rollout_weights_mode": "vllm"},
            r"rollout_weights_mode='vllm': ART's modes are 'lora' and 'merged'",
        ),
        ({"trainer_gpu_ids": [1]}, r"must both be set or both unset"),
        ({"chat_template": "x", "chat_template_path": "y"}, r"only one of chat_template"),
        ({"chat_template_path": "/no/such/file"}, r"cannot be read"),
        ({"peft_args": {"r": 0}}, r"lora_rank=0"),
        ({"something_new": 1}, r"\['something_new'\] are unknown"),
    ],
)
def test_keys_without_an_equivalent_are_refused(internal: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        model_settings(internal, TrainerConfig())


async def test_register_refuses_before_starting_anything(tmp_path: Path, tiny_model_path: Path) -> None:
    pool = art.SGLangConfig(max_lora_rank=64, lora_experimental_path=False)  # a pool for several ranks
    async with art.SGLangBackend(path=str(tmp_path / ".art"), sglang_config=pool) as backend:
        model = art.TrainableModel(
            name="m",
            project="p",
            base_model=str(tiny_model_path),
            _internal_config={"peft_args": {"r": 128}},  # above the server's max_lora_rank
        )
        with pytest.raises(ConfigError, match=r"lora_rank=128\) exceeds SGLangConfig\(max_lora_rank=64"):
            await model.register(backend)
        gpus = art.TrainableModel(
            name="g",
            project="p",
            base_model=str(tiny_model_path),
            _internal_config={"trainer_gpu_ids": [1], "inference_gpu_ids": [0]},
        )
        with pytest.raises(
            ConfigError, match=r"_internal_config trainer_gpu_ids/inference_gpu_ids: .*no GPU"
        ):
            await gpus.register(backend)
        assert backend.inference is None and not (tmp_path / ".art" / "p").exists()


def test_arts_merged_rollouts_are_the_merged_weight_sync() -> None:
    merged = model_settings({"rollout_weights_mode": "merged"}, TrainerConfig())
    assert merged.server_updates == {"weight_sync_method": "merged"}
    assert model_settings({"rollout_weights_mode": "lora"}, TrainerConfig()).server_updates == {}
