"""Configurations and train() options that cannot work fail at once, before any process starts, with a
message naming the fix."""

from __future__ import annotations

import psutil
import pytest

from art_sglang import ConfigError, SGLangBackend, SGLangConfig, TrainerConfig
from art_sglang.devices import DeviceLayout
from art_sglang.train_args import build_train_options

CPU_SHARED = DeviceLayout("shared", "reference", (), (), "forced for tests")


def _children() -> int:
    return len(psutil.Process().children(recursive=True))


def test_lora_rank_above_server_max_names_both_settings():
    before = _children()
    with pytest.raises(ConfigError, match=r"lora_rank=32.*max_lora_rank=16.*raise max_lora_rank"):
        SGLangBackend(
            engine="reference",
            sglang_config=SGLangConfig(max_lora_rank=16),
            trainer_config=TrainerConfig(lora_rank=32),
        )
    assert _children() == before


def test_trained_modules_must_be_served():
    with pytest.raises(ConfigError, match=r"\['down_proj'.*lora_target_modules=\['all'\]"):
        SGLangBackend(
            engine="reference",
            sglang_config=SGLangConfig(lora_target_modules=["qkv_proj", "o_proj"]),
            trainer_config=TrainerConfig(target_modules=["q_proj", "v_proj", "down_proj", "up_proj"]),
        )


def test_fused_server_targets_cover_their_parts():
    backend = SGLangBackend(
        engine="reference",
        sglang_config=SGLangConfig(lora_target_modules=["qkv_proj"]),
        trainer_config=TrainerConfig(target_modules=["q_proj", "k_proj", "v_proj"]),
    )
    assert backend.layout.mode == "cpu"


def test_bad_strategy_and_engine_names():
    with pytest.raises(ConfigError, match="'sleep' or 'restart'"):
        SGLangBackend(shared_strategy="nap")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'auto', 'sglang' or 'reference'"):
        SGLangBackend(engine="vllm")  # type: ignore[arg-type]


def test_gpus_with_the_cpu_engine_are_refused():
    with pytest.raises(ConfigError, match="engine='reference' runs on CPU"):
        SGLangBackend(engine="reference", inference_device=0, training_devices=[1])


def test_sleep_turns_on_the_memory_saver_and_refuses_it_switched_off():
    backend = SGLangBackend(layout=CPU_SHARED, shared_strategy="sleep")
    assert backend.sglang_config.enable_memory_saver and backend.sglang_config.enable_weights_cpu_backup
    assert backend.handoff_strategy == "sleep"
    restart = SGLangBackend(layout=CPU_SHARED, shared_strategy="restart")
    assert not restart.sglang_config.enable_memory_saver and restart.handoff_strategy == "restart"
    with pytest.raises(ConfigError, match=r"needs SGLangConfig\(enable_memory_saver=True\).*'restart'"):
        SGLangBackend(
            layout=CPU_SHARED, shared_strategy="sleep", sglang_config=SGLangConfig(enable_memory_saver=False)
        )


def _options(**overrides):
    values = dict(
        learning_rate=1e-5, loss_fn="ppo", epsilon=None, epsilon_high=None, scale_rewards=True,
        normalize_advantages=True, kl_penalty_coef=0.0, max_grad_norm=None,
        allow_training_without_logprobs=False, save_checkpoint=True, extra={},
    )  # fmt: skip
    values.update(overrides)
    return build_train_options(**values)


def test_art_options_at_their_default_are_accepted_and_mapped():
    options = _options(extra={"advantage_balance": 0.0, "importance_sampling_level": "token"}, epsilon=0.1)
    assert options.epsilon == 0.1 and options.epsilon_high == 0.1
    assert _options(normalize_advantages=False).scale_rewards is False


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"advantage_balance": 0.5}, r"advantage_balance=0.5 is not supported.*default 0.0"),
        ({"kl_penalty_reference_step": 3}, r"kl_penalty_reference_step=3.*base model"),
        ({"packed_sequence_length": 4096}, r"packed_sequence_length.*TrainerConfig\(max_seq_length"),
        ({"learning_rte": 1e-5}, r"unknown option 'learning_rte'.*takes learning_rate"),
    ],
)
def test_unsupported_or_unknown_options_are_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        _options(extra=extra)


def test_other_loss_functions_and_bad_values_are_errors():
    with pytest.raises(ConfigError, match=r"loss_fn='cispo' is not supported.*use loss_fn='ppo'"):
        _options(loss_fn="cispo")
    with pytest.raises(ConfigError, match=r"invalid train\(\) option: learning_rate=-1.0"):
        _options(learning_rate=-1.0)


def test_adapter_directories_are_checked_locally_before_loading(tmp_path):
    from art_sglang.errors import AdapterLoadError
    from art_sglang.model_store import check_adapter

    missing = tmp_path / "missing"
    with pytest.raises(AdapterLoadError, match=f"{missing} is not a directory"):
        check_adapter(missing, 64)
    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(AdapterLoadError, match=r"has no adapter_config\.json"):
        check_adapter(folder, 64)
    (folder / "adapter_config.json").write_text('{"r": 128}')
    with pytest.raises(AdapterLoadError, match=r"has no adapter_model\.safetensors or adapter_model\.bin"):
        check_adapter(folder, 64)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(
        AdapterLoadError, match=r"rank 128, above the server's max_lora_rank=64.*at least 128"
    ):
        check_adapter(folder, 64)
    check_adapter(folder, 128)


def test_gpu_uuids_reach_the_children_unchanged(tmp_path):
    # CUDA_VISIBLE_DEVICES may name GPUs by UUID; the server and trainer must get the same names.
    from art_sglang.server.process import ServerProcess
    from art_sglang.training.process import TrainerProcess

    split = DeviceLayout("split", "sglang", (0,), (1,), "test", cuda_ids=("GPU-aa11", "GPU-bb22"))
    backend = SGLangBackend(layout=split)
    inference, training = backend._gpu_ids("inference"), backend._gpu_ids("training")
    assert (inference, training) == (["GPU-aa11"], ["GPU-bb22"])
    server = ServerProcess(
        SGLangConfig(), "m", engine="sglang", log_path=tmp_path / "s.log", gpu_ids=inference
    )
    trainer = TrainerProcess(
        "m", tmp_path / "ckpt", TrainerConfig(), gpu_ids=training, log_path=tmp_path / "t.log"
    )
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-aa11"
    assert trainer.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-bb22"
