"""Helpers of the contract tests: the server under test, adapters made with peft, SSE parsing, and the
JSON-shape comparison against SGLang's recorded answers. Engine-agnostic: nothing here knows which
engine answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from art_sglang.config import SGLangConfig
from art_sglang.serving.servers.process import ServerProcess

GOLDEN_PATH = Path(__file__).parent / "golden" / "sglang-0.5.17-golden.json"
MESSAGES = [{"role": "user", "content": "hello"}]


def load_golden() -> list[dict[str, Any]]:
    return json.loads(GOLDEN_PATH.read_text())["cases"]


def contract_config(engine: str, **overrides: Any) -> SGLangConfig:
    """The flags the golden file was recorded with (on SGLang: its default attention, PyTorch sampling, its
    own LoRA backend: the contract's adapters have ranks 8 and 32 in a pool of 16, which the experimental
    LoRA path does not serve)."""
    values: dict[str, Any] = {
        "lora_backend": None,
        "lora_experimental_path": False,
        "max_lora_rank": 16,
        "lora_target_modules": ["all"],
        "max_loras_per_batch": 4,
        "mem_fraction_static": 0.3,
        "disable_cuda_graph": True,
        "enable_cache_report": True,
        "enable_metrics": True,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
    }
    if engine == "sglang":
        # SGLang's own attention (FlashAttention-3 on Hopper); FlashInfer's sampling kernels compile at
        # first use and the GPU machine has no CUDA compiler.
        values.update(sampling_backend="pytorch")
    values.update(overrides)
    return SGLangConfig(**values)


@contextlib.contextmanager
def running_server(
    config: SGLangConfig, model_path: str, engine: str, log_path: Path
) -> Iterator[ServerProcess]:
    """A started server, stopped (whole tree) on exit."""
    server = ServerProcess(config, model_path, engine=engine, log_path=log_path)  # type: ignore[arg-type]
    asyncio.run(server.start())
    try:
        yield server
    finally:
        asyncio.run(server.stop())


def wait_until_dead(server: ServerProcess, seconds: float = 60.0) -> None:
    """Assert the server exits within `seconds` (SGLang sleeps 5 s for crash diagnostics before it exits)."""
    deadline = time.monotonic() + seconds
    while server.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.is_alive()


def make_adapter(
    model_path: str, out: Path, *, rank: int, targets: list[str], seed: int, scale: float = 1.0
) -> Path:
    """A random (non-zero) LoRA adapter saved by peft; `scale` multiplies lora_B so the effect is large."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(out)
    return out


def make_perturbed_model(model_path: str, out: Path, *, seed: int) -> Path:
    """A copy of the model (tokenizer included) with noise added to every weight."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.std().clamp(min=1e-3))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    return out


def chat(client: httpx.Client, model: str = "default", **body: Any) -> httpx.Response:
    payload = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=payload)


def greedy(client: httpx.Client, model: str = "default", **body: Any) -> str:
    """Greedy chat content (EOS ignored so every answer has the same length)."""
    response = chat(client, model, max_tokens=12, ignore_eos=True, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def parse_sse(text: str) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or the string '[DONE]'."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), f"not an SSE data line: {block[:80]!r}"
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# SGLang internals the reference engine does not reproduce (scheduler timings and GPU details); every
# other key SGLang returned must be present with the same JSON type.
NOT_REPRODUCED = {
    "forward_entry_time",
    "prefill_finished_time",
    "queue_time",
    "dp_rank",
    "request_received_ts",
    "api_server_dispatch_finish_ts",
    "request_finished_ts",
    "decode_throughput",
    "response_sent_to_client_ts",
    "embedding",
    "cache",
}
# Values whose type legitimately varies with the run: null or not (cache hits, stop matches), or a
# finish reason of another kind (a random model may emit EOS).
VARIABLE = {"prompt_tokens_details", "cached_tokens_details", "matched_stop", "finish_reason"}
# Objects keyed by data (token text -> logprob in text completions): only the value types are compared.
MAPPINGS = {"top_logprobs"}


def shape_mismatches(ours: Any, golden: Any, path: str = "$", mapping: bool = False) -> list[str]:
    """Where `ours` differs in JSON shape from `golden`: missing keys and differing value types."""
    if isinstance(golden, dict):
        if not isinstance(ours, dict):
            return [f"{path}: expected an object, got {type(ours).__name__}"]
        if mapping:
            if golden and ours:
                return shape_mismatches(next(iter(ours.values())), next(iter(golden.values())), f"{path}.*")
            return []
        problems = []
        for key, value in golden.items():
            if key in NOT_REPRODUCED:
                continue
            if key not in ours:
                problems.append(f"{path}.{key}: missing")
            elif key not in VARIABLE:
                problems += shape_mismatches(ours[key], value, f"{path}.{key}", key in MAPPINGS)
        return problems
    if isinstance(golden, list):
        if not isinstance(ours, list):
            return [f"{path}: expected a list, got {type(ours).__name__}"]
        if golden and ours:
            return shape_mismatches(ours[0], golden[0], f"{path}[0]", mapping)
        return []
    if golden is None or ours is None:
        return [] if golden is ours else [f"{path}: expected {golden!r}, got {ours!r}"]
    numbers = (int, float)
    if isinstance(golden, bool) or isinstance(ours, bool):
        same = isinstance(golden, bool) and isinstance(ours, bool)
    elif isinstance(golden, numbers):
        same = isinstance(ours, numbers)
    else:
        same = type(golden) is type(ours)
    return [] if same else [f"{path}: expected {type(golden).__name__}, got {type(ours).__name__}"]
