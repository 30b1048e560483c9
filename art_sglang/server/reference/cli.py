"""Command line of the reference engine: the flags of `python -m sglang.launch_server` that
`SGLangConfig.server_args()` renders, plus `--lora-paths` and `--served-model-name`.

GPU-only flags are accepted and ignored (one log line); unknown flags are accepted and logged, because users
pass SGLang flags through `SGLangConfig.extra_args` and the same command line must start either engine.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from .tool_calls import PARSERS as TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

# Accepted for command-line compatibility with SGLang; they tune GPU memory or kernels, which a CPU
# engine does not have.
GPU_ONLY_FLAGS = (
    "mem_fraction_static",
    "tp_size",
    "attention_backend",
    "sampling_backend",
    "disable_cuda_graph",
    "max_loras_per_batch",
)


class ServerArgs(BaseModel):
    """Parsed launch flags (SGLang's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float | None = None
    tp_size: int = 1
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    lora_paths: dict[str, str] = Field(default_factory=dict)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    context_length: int | None = None
    max_total_tokens: int = Field(
        32768, ge=1, description="Token budget of the prefix cache (SGLang: KV pool)."
    )
    attention_backend: str | None = None
    sampling_backend: str | None = None
    disable_radix_cache: bool = False
    enable_cache_report: bool = False
    enable_metrics: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    disable_cuda_graph: bool = False
    api_key: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    random_seed: int | None = None
    log_level: str = "info"
    ignored_args: list[str] = Field(default_factory=list, description="Unknown flags, kept for the log.")

    @property
    def model_name(self) -> str:
        """The base model's id in `/v1/models` (SGLang: served name, else the model path)."""
        return self.served_model_name or self.model_path


def _parse_lora_paths(items: list[str]) -> dict[str, str]:
    """`name=path` or a bare `path` (named by itself), as SGLang accepts them."""
    paths: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        paths[name if sep else item] = path if sep else item
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m art_sglang.server.reference",
        description="CPU reference engine speaking SGLang 0.5.17's HTTP subset (transformers + peft).",
    )
    add = parser.add_argument
    add("--model-path", "--model", required=True)
    add("--tokenizer-path")
    add("--served-model-name")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--mem-fraction-static", type=float)
    add("--tp-size", "--tensor-parallel-size", type=int, default=1)
    add("--enable-lora", action="store_true")
    add("--max-lora-rank", type=int)
    add("--lora-target-modules", nargs="+")
    add("--lora-paths", nargs="+", default=[])
    add("--max-loras-per-batch", type=int, default=8)
    add("--max-loaded-loras", type=int)
    add("--context-length", type=int)
    add("--max-total-tokens", type=int, default=32768)
    add("--attention-backend")
    add("--sampling-backend")
    add("--disable-radix-cache", action="store_true")
    add("--enable-cache-report", action="store_true")
    add("--enable-metrics", action="store_true")
    add("--enable-memory-saver", action="store_true")
    add("--enable-weights-cpu-backup", action="store_true")
    add("--disable-cuda-graph", action="store_true")
    add("--api-key")
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="Parsers of the <tool_call> JSON markup.")
    add("--chat-template", help="A chat template file (builtin template names are SGLang's only).")
    add("--random-seed", type=int)
    add("--log-level", default="info")
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse `argv`; unknown flags are kept in `ignored_args` instead of failing."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if namespace.chat_template is not None and not Path(namespace.chat_template).is_file():
        parser.error(
            f"--chat-template {namespace.chat_template}: no such file (the reference engine reads files)"
        )
    values = vars(namespace)
    values["lora_paths"] = _parse_lora_paths(values["lora_paths"])
    return ServerArgs(**values, ignored_args=unknown)


def log_ignored(args: ServerArgs) -> None:
    """One log line for GPU-only flags that were set, one for unknown flags."""
    defaults = ServerArgs(model_path=args.model_path)
    gpu_set = [name for name in GPU_ONLY_FLAGS if getattr(args, name) != getattr(defaults, name)]
    if gpu_set:
        logger.info("ignoring GPU-only flags on the CPU reference engine: %s", ", ".join(gpu_set))
    if args.ignored_args:
        logger.info("ignoring flags the reference engine does not know: %s", " ".join(args.ignored_args))
