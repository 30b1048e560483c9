"""Command line of the reference engine: the flags of `python -m sglang.launch_server` that
`SGLangConfig.server_args()` renders, plus `--lora-paths` and `--served-model-name`. `ServerArgs` is its one
definition: the parser is built from its fields (flag, kind, SGLang's default), with the help of the
flags SGLangConfig renders taken from SGLangConfig's descriptions.

GPU-only flags are accepted and ignored (one log line); unknown flags are accepted and logged, because users
pass SGLang flags through `SGLangConfig.extra_args` and the same command line must start either engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from art_sglang.config import LAUNCH_FLAGS, SGLangConfig

from .tool_calls import FORMATS as TOOL_CALL_FORMATS

logger = logging.getLogger(__name__)

# Accepted for command-line compatibility with SGLang; they tune GPU memory or kernels, which a CPU
# engine does not have.
GPU_ONLY_FLAGS = (
    "mem_fraction_static",
    "tp_size",
    "attention_backend",
    "sampling_backend",
    "disable_cuda_graph",
    "disable_prefill_cuda_graph",
    "max_loras_per_batch",
    "lora_backend",
)


class ServerArgs(BaseModel):
    """Parsed launch flags (SGLang's names and defaults); each field is the flag of its name."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(json_schema_extra={"aliases": ["--model"]})
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float | None = None
    tp_size: int = Field(1, json_schema_extra={"aliases": ["--tensor-parallel-size"]})
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    lora_paths: dict[str, str] = Field(default_factory=dict)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_backend: str | None = None
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
    disable_prefill_cuda_graph: bool = False
    api_key: str | None = Field(
        None, description="Key of every route but /health* and /metrics (Bearer or x-api-key)."
    )
    admin_api_key: str | None = Field(
        None,
        description="Key of the admin routes (adapters, weights, memory, cache); when set, --api-key no "
        "longer opens them.",
    )
    tool_call_parser: str | None = Field(
        None,
        description="Parsers of the <tool_call> JSON markup.",
        json_schema_extra={"choices": list(TOOL_CALL_FORMATS)},
    )
    chat_template: str | None = Field(
        None, description="A chat template file (builtin template names are SGLang's only)."
    )
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
    """One option per ServerArgs field; an absent flag stays out of the namespace (ServerArgs' default)."""
    parser = argparse.ArgumentParser(
        prog="python -m art_sglang_reference",
        description="CPU reference engine speaking SGLang 0.5.17's HTTP subset (transformers + peft).",
    )
    for name, field in ServerArgs.model_fields.items():
        if name != "ignored_args":
            _add_flag(parser, name, field)
    # Read by parse_args before parsing (its flags go in front of the command line's).
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, help="A YAML or JSON file of flags; the command line wins."
    )
    return parser


# Help for the flags SGLangConfig renders, by reference field (the names differ only for --tp-size).
_CONFIG_HELP = {
    flag[2:].replace("-", "_"): SGLangConfig.model_fields[name].description
    for name, flag in LAUNCH_FLAGS.items()
}


def _add_flag(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    """`--<name>` with the kind its annotation says: a switch (bool), one or more values (list, dict) or
    one value (int, float, str)."""
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType):  # `X | None`: the flag takes an X
        kind = next(a for a in get_args(kind) if a is not type(None))
    extra: dict[str, Any] = field.json_schema_extra or {}  # type: ignore[assignment]
    options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    if kind is bool:
        options["action"] = "store_true"
    elif get_origin(kind) in (list, dict):
        options["nargs"] = "+"
    elif kind in (int, float):
        options["type"] = kind
    if field.is_required():
        options["required"] = True
    if "choices" in extra:
        options["choices"] = extra["choices"]
    help_text = field.description or _CONFIG_HELP.get(name)
    if help_text:
        options["help"] = help_text
    parser.add_argument("--" + name.replace("_", "-"), *extra.get("aliases", ()), **options)


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse `argv`; unknown flags are kept in `ignored_args` instead of failing. `--config FILE` (YAML or
    JSON: flag names without dashes as keys) gives flags as SGLang's does: the command line wins."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            parser.error("--config needs a file")
        argv = [*_config_file_flags(parser, argv[at + 1]), *argv[:at], *argv[at + 2 :]]
    namespace, unknown = parser.parse_known_args(argv)
    values = vars(namespace)
    template = values.get("chat_template")
    if template is not None and not Path(template).is_file():
        parser.error(f"--chat-template {template}: no such file (the reference engine reads files)")
    if "lora_paths" in values:
        values["lora_paths"] = _parse_lora_paths(values["lora_paths"])
    return ServerArgs(**values, ignored_args=unknown)


def _config_file_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a `--config` file stands for (`key: value` -> `--key value`, `key: true` -> `--key`)."""
    import yaml  # comes with transformers, which the engine needs anyway

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: the file must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            parser.error(f"--config {path}: 'config' cannot be given in a config file")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags.extend([flag, *map(str, value)])
        elif value is not None and value is not False:
            flags.append(f"{flag}={value}")  # one token, so a value starting with "-" stays a value
    return flags


def log_ignored(args: ServerArgs) -> None:
    """One log line for GPU-only flags that were set, one for unknown flags."""
    defaults = ServerArgs(model_path=args.model_path)
    gpu_set = [name for name in GPU_ONLY_FLAGS if getattr(args, name) != getattr(defaults, name)]
    if gpu_set:
        logger.info("ignoring GPU-only flags on the CPU reference engine: %s", ", ".join(gpu_set))
    if args.ignored_args:
        logger.info("ignoring flags the reference engine does not know: %s", " ".join(args.ignored_args))
