"""SGLangConfig / DeviceConfig / TrainerConfig: defaults, validation messages and the rendered command line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_sglang.config import LAUNCH_FLAGS, DeviceConfig, SGLangConfig, TrainerConfig
from art_sglang.server_defaults import find_server_python


def test_defaults_render_the_flags_the_backend_relies_on() -> None:
    args = SGLangConfig(lora_target_modules=["all"]).server_args("/models/m", 30001)
    joined = " ".join(args)
    assert args[:6] == ["--model-path", "/models/m", "--host", "127.0.0.1", "--port", "30001"]
    assert "--enable-lora" in args
    assert "--max-lora-rank 8" in joined  # unset outside a backend: the default trainer's rank
    assert "--lora-target-modules all" in joined
    assert "--max-loras-per-batch 4" in joined
    assert "--lora-backend triton" in joined  # the experimental path is the environment's, settled by a plan
    assert "--enable-cache-report" in args
    absent = (
        "--disable-radix-cache",
        "--enable-memory-saver",
        "--api-key",
        "--context-length",
    )
    assert not set(absent) & set(args)


def test_merged_weights_start_the_server_without_lora() -> None:
    """weight_sync_method='merged' never loads an adapter: no LoRA kernels, no LoRA flag at all."""
    config = SGLangConfig(weight_sync_method="merged", lora_backend="triton", lora_target_modules=["all"])
    args = config.server_args("/models/m", 30001)
    assert not [arg for arg in args if "lora" in arg]
    assert "--enable-cache-report" in args


def test_optional_flags_and_extra_args_are_rendered() -> None:
    config = SGLangConfig(
        context_length=2048,
        attention_backend="triton",
        sampling_backend="pytorch",
        lora_backend="triton",
        disable_radix_cache=True,
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        disable_cuda_graph=True,
        disable_prefill_cuda_graph=True,
        api_key="k",
        lora_target_modules=["q_proj", "v_proj"],
        extra_args=["--log-level", "debug"],
    )
    args = config.server_args("m", 1)
    joined = " ".join(args)
    for expected in (
        "--context-length 2048",
        "--attention-backend triton",
        "--sampling-backend pytorch",
        "--lora-backend triton",
        "--disable-radix-cache",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--disable-cuda-graph",
        "--disable-prefill-cuda-graph",
        "--lora-target-modules q_proj v_proj",
    ):
        assert expected in joined
    assert args[-2:] == ["--log-level", "debug"]
    assert "--api-key" not in args and "k" not in args  # keys go to the server in a private file


def test_launch_flags_come_from_the_marked_fields() -> None:
    assert LAUNCH_FLAGS["max_lora_rank"] == "--max-lora-rank"
    assert LAUNCH_FLAGS["tensor_parallel_size"] == "--tp-size"
    for not_a_flag in ("host", "port", "api_key", "weight_sync_method", "extra_args"):
        assert not_a_flag not in LAUNCH_FLAGS
    args = SGLangConfig(tensor_parallel_size=2, tool_call_parser=None).server_args("m", 1)
    assert args[args.index("--tp-size") + 1] == "2" and "--tool-call-parser" not in args


def test_keys_cannot_be_put_on_the_command_line() -> None:
    for extra in (["--api-key", "k"], ["--admin-api-key=k"], ["--config", "mine.yaml"]):
        with pytest.raises(ValueError, match="private --config file"):
            SGLangConfig(extra_args=extra)


def test_server_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_SERVER_TIMEOUT", "180")
    assert SGLangConfig().server_timeout == 180.0
    assert SGLangConfig(startup_timeout=5).server_timeout == 5.0
    monkeypatch.setenv("ART_SERVER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"ART_SERVER_TIMEOUT='soon' is not a number"):
        SGLangConfig()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mem_fraction_static": 1.5}, "less than 1"),
        ({"weight_sync_method": "tensor"}, r"'lora', 'disk', 'restart' or 'merged'"),
        ({"enable_weights_cpu_backup": True}, "needs enable_memory_saver=True"),
        ({"max_loras_per_batch": 1}, "max_loras_per_batch must be >= 2"),
        ({"lora_target_modules": [" "]}, "must not contain empty names"),
        ({"unknown_flag": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_sglang_config_is_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SGLangConfig(**kwargs)


def test_single_adapter_pool_works_when_only_one_adapter_is_kept() -> None:
    assert SGLangConfig(max_loras_per_batch=1, adapters_to_keep=1).max_loras_per_batch == 1


def test_device_config_validation() -> None:
    assert DeviceConfig().training_devices == [1]
    with pytest.raises(ValidationError, match="lists GPU 1 more than once"):
        DeviceConfig(training_devices=[1, 1])
    with pytest.raises(ValidationError, match="GPU indices >= 0"):
        DeviceConfig(training_devices=[-1])


def test_trainer_config_defaults() -> None:
    config = TrainerConfig()
    assert config.lora_rank == 8 and SGLangConfig().max_lora_rank is None  # the plan sets the trainer's
    assert "down_proj" in config.target_modules


def test_server_python_found_in_a_parent_venv(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ART_SGLANG_SERVER_PYTHON", raising=False)
    python = tmp_path / ".venv-sglang-server" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    assert find_server_python(nested) == str(python)
    monkeypatch.setenv("ART_SGLANG_SERVER_PYTHON", "/opt/py")
    assert find_server_python(nested) == "/opt/py"


def test_pipelining_sizes_the_adapter_pool_or_refuses_a_small_one() -> None:
    assert SGLangConfig(max_steps_off_policy=2).max_loras_per_batch == 4  # the default already holds 3
    config = SGLangConfig(max_steps_off_policy=6)
    assert config.max_loras_per_batch == 7
    assert "--max-loras-per-batch 7" in " ".join(config.server_args("m", 1))
    with pytest.raises(ValidationError, match="raise max_loras_per_batch to 5"):
        SGLangConfig(max_steps_off_policy=4, max_loras_per_batch=4)
