"""The reference engine accepts every command line `SGLangConfig.server_args()` renders, keeps unknown flags
instead of failing, and parses `--lora-paths` as SGLang does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from art_sglang.config import LAUNCH_FLAGS, SGLangConfig
from art_sglang_reference.cli import build_parser, parse_args


def test_every_rendered_flag_is_understood() -> None:
    config = SGLangConfig(
        mem_fraction_static=0.5,
        disable_radix_cache=True,
        max_loras_per_batch=3,
        context_length=512,
        max_lora_rank=32,
        lora_target_modules=["q_proj", "v_proj"],
        attention_backend="triton",
        sampling_backend="pytorch",
        lora_backend="triton",
        enable_cache_report=True,
        enable_metrics=True,
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        disable_cuda_graph=True,
        disable_prefill_cuda_graph=True,
        tensor_parallel_size=2,
    )
    args = parse_args(config.server_args("/models/m", 4321))
    assert args.ignored_args == []
    assert (args.model_path, args.host, args.port) == ("/models/m", "127.0.0.1", 4321)
    assert (args.mem_fraction_static, args.tp_size, args.max_loras_per_batch) == (0.5, 2, 3)
    assert args.enable_lora and args.max_lora_rank == 32
    assert args.lora_target_modules == ["q_proj", "v_proj"]
    assert args.context_length == 512
    assert (args.attention_backend, args.sampling_backend) == ("triton", "pytorch")
    assert args.lora_backend == "triton"
    assert args.disable_radix_cache and args.enable_cache_report and args.enable_metrics
    assert args.enable_memory_saver and args.enable_weights_cpu_backup and args.disable_cuda_graph
    assert args.disable_prefill_cuda_graph


def test_every_launch_flag_of_the_config_is_a_reference_option() -> None:
    options = set(re.findall(r"--[a-z0-9-]+", build_parser().format_usage()))
    assert set(LAUNCH_FLAGS.values()) <= options
    assert {"--model-path", "--host", "--port", "--enable-lora"} <= options


def test_absent_flags_take_sglangs_defaults() -> None:
    args = parse_args(["--model", "m"])
    assert (args.model_path, args.host, args.port, args.tp_size) == ("m", "127.0.0.1", 30000, 1)
    assert (args.max_loras_per_batch, args.max_total_tokens, args.lora_paths) == (8, 32768, {})
    assert not args.enable_lora and args.lora_target_modules is None and args.log_level == "info"


def test_unknown_flags_are_kept_and_lora_paths_parsed() -> None:
    argv = [
        "--model-path",
        "m",
        "--lora-paths",
        "a=/x/a",
        "/x/b",
        "--served-model-name",
        "s",
        "--chunked-prefill-size",
        "8",
    ]
    args = parse_args(argv)
    assert args.lora_paths == {"a": "/x/a", "/x/b": "/x/b"}
    assert args.model_name == "s"
    assert args.ignored_args == ["--chunked-prefill-size", "8"]
    assert parse_args(["--model-path", "m"]).model_name == "m"


def test_help_runs_without_loading_a_model() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "art_sglang_reference", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--lora-target-modules" in done.stdout


def test_a_config_file_gives_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("api-key: from-file\nadmin_api_key: -admin\ncontext-length: 128\nenable-metrics: true\n")
    args = parse_args(["--model-path", "m", "--config", str(keys), "--context-length", "256"])
    assert (args.api_key, args.admin_api_key, args.context_length, args.enable_metrics) == (
        "from-file",
        "-admin",  # a key may start with "-"
        256,
        True,
    )
    (tmp_path / "bad.yaml").write_text("config: other.yaml\n")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--config", str(tmp_path / "bad.yaml")])
