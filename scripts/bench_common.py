"""What the benchmark scripts share: launch settings from the command line, a random LoRA adapter of a
model's shape (a serving benchmark needs no trained one), ART's OpenAI client, the device and versions,
and result output (JSON plus a markdown table)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

from art_sglang.config import DEFAULT_LORA_TARGETS, SGLangConfig
from art_sglang.planning.make_plan import experimental_path_runs

COMMIT_ENV = "ART_SGLANG_COMMIT"
# SGLang's LoRA kernels as SGLangConfig chooses them by default (the benches' default too).
DEFAULT_LORA_BACKEND = SGLangConfig.model_fields["lora_backend"].default
DEFAULT_LORA_EXPERIMENTAL_PATH = SGLangConfig.model_fields["lora_experimental_path"].default


def add_server_args(
    parser: argparse.ArgumentParser, engines: tuple[str, ...] = ("sglang", "reference")
) -> None:
    parser.add_argument("--engine", choices=engines, default="sglang")
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="model folder")
    parser.add_argument(
        "--mem-fraction-static",
        type=fraction_or_auto,
        default=0.5,
        help="SGLang --mem-fraction-static (vLLM: --gpu-memory-utilization); 'auto' leaves it unset: the "
        "backend's shared-mode plan then sizes it, and an engine started directly takes its own default",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture CUDA graphs (slower start, faster decode; vLLM: off = --enforce-eager)",
    )
    parser.add_argument(
        "--prefill-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SGLang only: off = --disable-prefill-cuda-graph (decode keeps its graphs; shorter start)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="the engine's own name, e.g. triton or fa3 for SGLang, FLASH_ATTN for vLLM; unset: the engine's "
        "default (SGLang: fa3 on Hopper)",
    )
    parser.add_argument("--sampling-backend", default=None, help="SGLang only, e.g. pytorch")
    parser.add_argument(
        "--sglang-args",
        type=shlex.split,
        default=[],
        help="SGLang only: further launch flags as one string, written --sglang-args='--schedule-policy lpm' "
        "(the = keeps a lone flag from being read as this script's own), e.g. '--tokenizer-worker-num 4'",
    )
    parser.add_argument(
        "--lora-backend",
        default=DEFAULT_LORA_BACKEND,
        help=f"SGLang only: SGLangConfig.lora_backend (default {DEFAULT_LORA_BACKEND}; or csgmv, SGLang's own)",
    )
    parser.add_argument(
        "--lora-experimental-path",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_LORA_EXPERIMENTAL_PATH,
        help="SGLang only: SGLangConfig.lora_experimental_path, 0.5.17's experimental triton LoRA path (unset: "
        "on with --lora-backend triton where the pool is --lora-rank wide, as a backend settles it)",
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="rank of the random adapter served")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(DEFAULT_LORA_TARGETS),
        help="SGLang only: the modules the server can adapt; by default those the random adapter adapts, "
        "as the backend serves the trainer's (" + " ".join(DEFAULT_LORA_TARGETS) + "); 'all' takes lm_head "
        "and embed_tokens too",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/art-sglang-bench"))


def training_bench_parser(description: str | None) -> argparse.ArgumentParser:
    """The command line of the benchmarks that train through the backend: the server's settings and the
    GRPO workload (character-share rollouts, LoRA r=16 by default)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.set_defaults(lora_rank=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per rollout (at most)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    return parser


def rollout_workload(args: argparse.Namespace) -> dict[str, Any]:
    """`training_bench_parser`'s workload as the results record it."""
    return {
        "task": "char_share (reward: share of vowels)", "groups": args.groups, "group_size": args.group_size,
        "max_tokens": args.max_tokens, "lora_rank": args.lora_rank, "learning_rate": args.learning_rate,
    }  # fmt: skip


def workload_phrase(workload: dict[str, Any]) -> str:
    """A `rollout_workload` in words, for a table's heading."""
    w = workload
    return f"{w['groups']} groups x {w['group_size']} rollouts of <= {w['max_tokens']} tokens, LoRA r={w['lora_rank']}"


def fraction_or_auto(text: str) -> float | None:
    """A memory fraction in (0, 1], or None for 'auto'."""
    if text == "auto":
        return None
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1] or 'auto', not {text}")
    return value


@dataclass(frozen=True)
class ServerSettings:
    """What a benchmarked server is started with, in terms every engine maps to its own flags."""

    model: str
    prefix_cache: bool = True
    # SGLang --mem-fraction-static, vLLM --gpu-memory-utilization; None: unset (the engine or plan decides)
    mem_fraction: float | None = 0.5
    cuda_graph: bool = True
    prefill_cuda_graph: bool = True  # SGLang only
    max_lora_rank: int = 8
    max_loras_per_batch: int = 4
    attention_backend: str | None = None  # the engine's own name
    sampling_backend: str | None = None  # SGLang only
    sglang_args: tuple[str, ...] = ()  # SGLang only: further launch flags as given
    lora_target_modules: tuple[str, ...] = tuple(DEFAULT_LORA_TARGETS)  # SGLang only
    lora_backend: str | None = DEFAULT_LORA_BACKEND  # SGLang only
    lora_experimental_path: bool | None = DEFAULT_LORA_EXPERIMENTAL_PATH  # SGLang only; None: where it runs
    lora_rank: int = 8  # the served adapters' rank
    lora: bool = True  # vLLM only: False serves the base weights without --enable-lora


def server_settings(args: argparse.Namespace, **changes: Any) -> ServerSettings:
    """The settings of `add_server_args`' options."""
    return ServerSettings(
        model=args.model,
        mem_fraction=args.mem_fraction_static,
        cuda_graph=args.cuda_graph,
        prefill_cuda_graph=args.prefill_cuda_graph,
        max_lora_rank=max(args.lora_rank, 8),
        attention_backend=args.attention_backend,
        sampling_backend=args.sampling_backend,
        sglang_args=tuple(args.sglang_args),
        lora_target_modules=tuple(args.lora_target_modules),
        lora_backend=args.lora_backend,
        lora_experimental_path=args.lora_experimental_path,
        lora_rank=args.lora_rank,
        **changes,
    )


def sglang_config(settings: ServerSettings, **overrides: Any) -> SGLangConfig:
    """The SGLang (or reference engine) launch config for `settings`, cached tokens reported in usage."""
    fields: dict[str, Any] = {
        "disable_radix_cache": not settings.prefix_cache,
        "disable_cuda_graph": not settings.cuda_graph,
        "disable_prefill_cuda_graph": not settings.prefill_cuda_graph,
        "attention_backend": settings.attention_backend,
        "sampling_backend": settings.sampling_backend,
        "enable_cache_report": True,
        "max_lora_rank": settings.max_lora_rank,
        "max_loras_per_batch": settings.max_loras_per_batch,
        "lora_target_modules": list(settings.lora_target_modules),
        "lora_backend": settings.lora_backend,
        "lora_experimental_path": settings.lora_experimental_path,
    }
    if settings.sglang_args:
        fields["extra_args"] = list(settings.sglang_args)
    if settings.mem_fraction is not None:  # unset, a shared-mode backend sizes it from the GPU's memory
        fields["mem_fraction_static"] = settings.mem_fraction
    fields.update(overrides)
    if fields["lora_experimental_path"] is None:  # settled as a backend's plan settles it
        fields["lora_experimental_path"] = experimental_path_runs(
            fields["lora_backend"], fields["max_lora_rank"], settings.lora_rank
        )
    return SGLangConfig(**fields)


def server_config(args: argparse.Namespace, **overrides: Any) -> SGLangConfig:
    return sglang_config(server_settings(args), **overrides)


def make_random_adapter(model_path: str, out: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT LoRA adapter for `model_path` on all linear layers, with small random A and B (B != 0, so
    it changes outputs). Built on the meta device: no weights are loaded."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # Reused only when it was made for this model and rank: a workdir shared by runs on two models once
    # served a 1.5B-shaped adapter to a 7B server (SGLang's scheduler died on the shape; vLLM took it).
    config = out / "adapter_config.json"
    if (out / "adapter_model.safetensors").exists() and config.exists():
        made = json.loads(config.read_text())
        if made.get("base_model_name_or_path") == model_path and made.get("r") == rank:
            return out
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(DEFAULT_LORA_TARGETS))
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        key: (torch.randn(value.shape, generator=generator) * 0.02).to(torch.bfloat16)
        for key, value in get_peft_model_state_dict(peft_model).items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    lora.base_model_name_or_path = model_path
    lora.save_pretrained(str(out))
    return out


_SGLANG_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?[^\]]*\] (.*)$")
_ELAPSED = re.compile(r"elapsed=([0-9.]+) s")
_PHASES = {
    "Load weight end": "load_weights_s",
    "Capture target decode": "decode_cuda_graphs_s",
    "Capture target prefill": "prefill_cuda_graphs_s",
}


def startup_phases(log_text: str) -> dict[str, float]:
    """Where an SGLang server's start went, from its log: the elapsed time SGLang 0.5.17 reports for
    loading weights and capturing the decode and prefill CUDA graphs, and `logged_s` from its first log
    line to "fired up" (what is before the first line is the interpreter importing sglang). The last start
    in the log counts."""
    started: dict[str, float] = {}
    phases: dict[str, float] = {}
    first: float | None = None
    for line in log_text.splitlines():
        found = _SGLANG_LOG_LINE.match(line)
        if not found:
            continue
        stamp = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S"))
        message = found[2]
        first = stamp if first is None else first
        elapsed = _ELAPSED.search(message)
        for start, name in _PHASES.items():
            if message.startswith(start) and " end." in message and elapsed:
                phases[name] = float(elapsed[1])
        if "fired up and ready" in message:
            started = {**phases, "logged_s": stamp - first}
            phases, first = {}, None
    return started


def art_openai_client(base_url: str, api_key: str, *, aiohttp_transport: bool = False) -> AsyncOpenAI:
    """The client an ART program's rollouts use, as `art.Model.openai_client()` builds it: `AsyncOpenAI` on
    httpx with a 20 min timeout and an unbounded keep-alive pool (or the same SDK on aiohttp). Its cost
    with hundreds of rollouts in flight is part of what an ART user gets from a server, so a speed
    comparison "as ART drives it" sends through it."""
    from openai import DefaultAioHttpClient, DefaultAsyncHttpxClient

    timeout = httpx.Timeout(1200.0, connect=5.0)
    limits = httpx.Limits(max_connections=100_000, max_keepalive_connections=100_000)
    maker = DefaultAioHttpClient if aiohttp_transport else DefaultAsyncHttpxClient
    return AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=maker(timeout=timeout, limits=limits))


def version_in(python: str, package: str) -> str | None:
    """`package`'s version as the interpreter `python` sees it (a server's own stack), or None."""
    done = subprocess.run(
        [python, "-c", f"from importlib.metadata import version; print(version({package!r}))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None if done.returncode == 0 else None


def device_name(env: dict[str, Any]) -> str:
    """The GPU(s) of `environment()` in one phrase, or "CPU"."""
    gpus = env["gpus"]
    if not gpus:
        return "CPU"
    return gpus[0] if len(gpus) == 1 else f"{len(gpus)}x {gpus[0]}"


def gpu_processes() -> list[dict[str, Any]]:
    """The processes holding GPU memory now, with their MiB (nvidia-smi; empty without it)."""
    rows = _nvidia_smi_rows("--query-compute-apps=pid,process_name,used_memory") or []
    return [{"pid": int(pid), "name": name, "used_mib": float(used)} for pid, name, used in rows]


def _nvidia_smi_rows(query: str) -> list[list[str]] | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def _commit() -> str | None:
    """The checkout's commit: `$ART_SGLANG_COMMIT` (a copy without .git, as on the GPU machine), else git's."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    done = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Where the numbers were taken: GPU (name, memory, driver, and its UUID, which tells whether two calls
    ran on one machine), host, versions, date and time, commit."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    packages = ("art-sglang", "torch", "transformers", "peft", "unsloth", "trl", "openai")
    rows = _nvidia_smi_rows("--query-gpu=name,memory.total,driver_version,uuid") or []
    return {
        "date": time.strftime("%Y-%m-%d"),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpus": [name for name, *_ in rows],
        "gpu_details": [
            dict(zip(("name", "memory_mib", "driver", "uuid"), row, strict=False)) for row in rows
        ],
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "commit": _commit(),
        "versions": {name: v(name) for name in packages},
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(args: argparse.Namespace, results: dict[str, Any], table: str) -> None:
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
