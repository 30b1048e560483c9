"""The inference engines the serving benchmarks compare, behind one handle: start and stop the server, how a
request names a LoRA adapter, how an adapter is loaded and unloaded at run time, and the engine's own
prefix-cache counters where it has them.

- `sglang` / `reference`: the project's `ServerProcess` with an `SGLangConfig` (the CPU reference engine
  speaks SGLang's API); an adapter is named `<base>:<adapter>` (a bare adapter name is the base model on
  SGLang 0.5.17), loaded by `POST /load_lora_adapter`.
- `vllm`: vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`) with LoRA and run-time adapter
  updates on; an adapter is named by its own name, loaded by `POST /v1/load_lora_adapter`; its `/metrics`
  counts prefix-cache queries and hits (in tokens).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

import httpx
from bench_common import DEFAULT_LORA_BACKEND, DEFAULT_LORA_EXPERIMENTAL_PATH, ServerSettings, sglang_config

from art_sglang.config import DEFAULT_LORA_TARGETS, SGLangConfig
from art_sglang.serving.servers.process import ServerProcess

EngineName = Literal["sglang", "reference", "vllm"]
VLLM_PYTHON_ENV = "ART_SGLANG_VLLM_PYTHON"  # the interpreter that has vLLM (its own stack, like SGLang's)
VLLM_ENV = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    # The device kit leaves FlashInfer's prebuilt kernels out; vLLM's own sampler needs none.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}
# vLLM accepts only these adapter ranks as --max-lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_args(settings: ServerSettings, *, host: str, port: int) -> list[str]:
    """Arguments after `python -m vllm.entrypoints.openai.api_server` for `settings`."""
    if settings.sampling_backend is not None:
        raise ValueError("vLLM has no --sampling-backend: leave it unset for --engine vllm")
    if settings.sglang_args:
        raise ValueError("--sglang-args are SGLang's flags: leave them unset for --engine vllm")
    if settings.lora_target_modules != tuple(DEFAULT_LORA_TARGETS):
        raise ValueError("--lora-target-modules is SGLang's flag (vLLM adapts what each adapter names)")
    sglang_lora = (settings.lora_backend, settings.lora_experimental_path)
    if sglang_lora != (DEFAULT_LORA_BACKEND, DEFAULT_LORA_EXPERIMENTAL_PATH):
        raise ValueError(
            "--lora-backend and --lora-experimental-path are SGLang's: leave them unset for vLLM"
        )
    if settings.lora and settings.max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(f"vLLM takes --max-lora-rank in {VLLM_LORA_RANKS}, not {settings.max_lora_rank}")
    args = [
        # --model, not a positional path: vLLM 0.24 would take the positional for a hub name.
        "--model", settings.model,
        "--host", host,
        "--port", str(port),
        # usage.prompt_tokens_details.cached_tokens, as SGLang's --enable-cache-report
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if settings.prefix_cache else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if settings.lora:  # else base weights alone, as a server of merged weights
        args += ["--enable-lora", "--max-lora-rank", str(settings.max_lora_rank),
                 "--max-loras", str(settings.max_loras_per_batch)]  # fmt: skip
    if settings.mem_fraction is not None:
        args += ["--gpu-memory-utilization", str(settings.mem_fraction)]
    if settings.attention_backend is not None:
        args += ["--attention-backend", settings.attention_backend]
    if not settings.cuda_graph:
        args.append("--enforce-eager")
    return args


class VLLMProcess(ServerProcess):
    """vLLM's OpenAI server as a subprocess, with the same launch, health wait and tree kill as ours."""

    def __init__(
        self, settings: ServerSettings, *, python: str, log_path: Path, port: int | None = None
    ) -> None:
        super().__init__(SGLangConfig(port=port), settings.model, engine="sglang", log_path=log_path)
        self.engine = "vllm"  # type: ignore[assignment]  # only names the server in messages and its log
        self.label = "vllm server"
        self.settings = settings
        self.python = python

    def command(self) -> list[str]:
        args = vllm_args(self.settings, host=self.config.host, port=self.port)
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", *args]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **VLLM_ENV}


class EngineServer:
    """One engine's server for a benchmark: `start()`, `stop()`, and its adapter API. SGLang (or the
    reference engine) takes `config` instead of `settings`' flags where given, and `keys` (the ordinary
    routes' key, the admin routes' key) as the backend passes them (a file its command line names)."""

    def __init__(
        self,
        engine: EngineName,
        settings: ServerSettings,
        *,
        log_path: Path,
        port: int | None = None,
        config: SGLangConfig | None = None,
        keys: tuple[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self._admin_headers = {"Authorization": f"Bearer {keys[1]}"} if keys else {}
        if engine == "vllm":
            if config is not None or keys is not None:
                raise ValueError("vLLM takes its flags from settings alone")
            python = os.environ.get(VLLM_PYTHON_ENV) or sys.executable
            self.process: ServerProcess = VLLMProcess(settings, python=python, log_path=log_path, port=port)
        else:
            config = (config or sglang_config(settings)).model_copy(update={"port": port})
            if keys:
                config = config.model_copy(update={"api_key": keys[0]})
            admin = keys[1] if keys else None
            self.process = ServerProcess(
                config, settings.model, engine=engine, log_path=log_path, admin_api_key=admin
            )

    @property
    def base_url(self) -> str:
        return self.process.base_url

    async def start(self) -> None:
        await self.process.start()

    async def stop(self) -> None:
        await self.process.stop()

    def command(self) -> list[str]:
        """The launch command (the port is chosen at start)."""
        return self.process.command()

    def interpreter(self) -> str:
        """The Python that runs the server (known before it starts)."""
        if isinstance(self.process, VLLMProcess):
            return self.process.python
        return self.process.config.resolved_server_python() if self.engine == "sglang" else sys.executable

    def adapter_model(self, name: str) -> str:
        """The `model` of a request served by the adapter loaded as `name`."""
        return name if self.engine == "vllm" else f"{self.settings.model}:{name}"

    async def load_adapter(self, http: httpx.AsyncClient, name: str, path: Path) -> None:
        await self._post(http, "load", {"lora_name": name, "lora_path": str(path)})

    async def unload_adapter(self, http: httpx.AsyncClient, name: str) -> None:
        await self._post(http, "unload", {"lora_name": name})

    async def _post(self, http: httpx.AsyncClient, verb: str, body: dict[str, str]) -> None:
        route = f"/v1/{verb}_lora_adapter" if self.engine == "vllm" else f"/{verb}_lora_adapter"
        response = await http.post(self.base_url + route, json=body, headers=self._admin_headers)
        if response.status_code != 200:
            raise RuntimeError(f"{self.engine} {route} -> {response.status_code}: {response.text[:500]}")

    async def prefix_cache_counters(self, http: httpx.AsyncClient) -> dict[str, float] | None:
        """vLLM's prefix-cache counters (tokens queried, tokens hit) since start; None for SGLang, which
        reports cached tokens per request only."""
        if self.engine != "vllm":
            return None
        response = await http.get(self.base_url + "/metrics")
        response.raise_for_status()
        return parse_prefix_cache_counters(response.text)


_SAMPLE = re.compile(r"^(vllm:prefix_cache_(?:queries|hits))(?:_total)?(?:\{[^}]*\})?\s+(\S+)$")


def parse_prefix_cache_counters(metrics: str) -> dict[str, float]:
    """`{"queries": tokens, "hits": tokens}` summed over engines from vLLM's Prometheus text."""
    totals = {"queries": 0.0, "hits": 0.0}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            totals[match.group(1).rsplit("_", 1)[1]] += float(match.group(2))
    return totals
