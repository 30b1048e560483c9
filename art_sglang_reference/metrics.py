"""Prometheus text for /metrics (with --enable-metrics), under SGLang's `sglang:` metric names."""

from __future__ import annotations

import time

from .engine import ReferenceEngine


def render_metrics(engine: ReferenceEngine, model_name: str, started: float) -> str:
    stats = engine.stats
    labels = f'{{engine_type="reference",model_name="{model_name}"}}'
    hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    rows = [
        ("num_requests_total", "counter", "Requests finished.", stats.num_requests),
        ("prompt_tokens_total", "counter", "Prompt tokens processed.", stats.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens),
        (
            "cached_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            stats.cached_tokens,
        ),
        ("e2e_request_latency_seconds_sum", "counter", "Summed request latency.", stats.e2e_seconds),
        ("num_running_reqs", "gauge", "Requests running or waiting for the model.", stats.running),
        ("cache_hit_rate", "gauge", "Cached share of prompt tokens.", hit_rate),
        ("token_usage", "gauge", "Tokens held by the prefix cache.", engine.prefix_cache.cached_tokens),
        ("num_loaded_loras", "gauge", "LoRA adapters loaded.", len(engine.adapters.loaded)),
        ("memory_released", "gauge", "1 while the weights are released.", int(engine.released)),
        (
            "weight_memory_usage_gb",
            "gauge",
            "Memory used by model weights in GB.",
            engine.model_bytes() / 2**30,
        ),
        ("uptime_seconds", "gauge", "Seconds since the server started.", time.time() - started),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} {kind}"]
        lines.append(f"sglang:{name}{labels} {float(value)}")
    return "\n".join(lines) + "\n"
