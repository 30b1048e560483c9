"""Where configuration is validated: the checks of settings against each other (server and trainer, the
replicas and their GPUs, shared mode, a cluster, a train() call's options, pipelining), each raising a
`ConfigError` that names the fix, before anything starts. A single field is checked where it is declared
(`config.py`, `training/options.py`); the GPUs asked for, where the layout is chosen (`devices.py`)."""

from __future__ import annotations

import math
from collections import Counter

from ..config import SGLangConfig, TrainerConfig, WeightSyncMethod
from ..errors import ConfigError
from ..training.options import TrainOptions
from .devices import DeviceLayout
from .serving_plan import SYNC_TRAITS, HandoffStrategy

# Replicas sharing a GPU hold at most this share of it for weights and KV cache together. Each server also
# needs memory outside that share (CUDA context, activations, LoRA buffers): on an H200 two replicas of
# 0.45 each held 97 % of it (measured).
MAX_SHARED_FRACTION = 0.9


def check_compatible(sglang: SGLangConfig, trainer: TrainerConfig) -> None:
    """Configuration clashes between server and trainer, found before anything starts."""
    if trainer.lora_rank > sglang.max_lora_rank:
        raise ConfigError(
            f"TrainerConfig(lora_rank={trainer.lora_rank}) exceeds SGLangConfig(max_lora_rank="
            f"{sglang.max_lora_rank}): the server could not load the adapters; raise max_lora_rank to "
            f"{trainer.lora_rank} or lower lora_rank"
        )
    if sglang.lora_target_modules is None:  # the server will serve the trainer's modules (`serve_trained`)
        return
    served = set(sglang.lora_target_modules)
    if "all" not in served:
        fused = {"qkv_proj": {"q_proj", "k_proj", "v_proj"}, "gate_up_proj": {"gate_proj", "up_proj"}}
        for name, parts in fused.items():
            if name in served:
                served |= parts
        missing = sorted(set(trainer.target_modules) - served)
        if missing:
            raise ConfigError(
                f"TrainerConfig(target_modules) trains {missing}, which SGLangConfig(lora_target_modules="
                f"{sglang.lora_target_modules}) does not serve: add them, or use lora_target_modules=['all']"
            )


def check_row_length(options: TrainOptions, trainer: TrainerConfig) -> None:
    if options.packed_sequence_length is not None and options.packed_sequence_length > trainer.max_seq_length:
        raise ConfigError(
            f"packed_sequence_length={options.packed_sequence_length} exceeds TrainerConfig(max_seq_length="
            f"{trainer.max_seq_length}): lower it, or raise max_seq_length"
        )


def check_replicas(config: SGLangConfig, layout: DeviceLayout, *, gateway: bool) -> None:
    """Settings several server replicas cannot share. `gateway`: clients reach the replicas through the
    adapter gateway (else through SGLang's router)."""
    if len(layout.replicas) > 1 and config.port is not None:
        raise ConfigError(
            f"SGLangConfig(port={config.port}) with several server replicas: each replica needs its own "
            "port; leave port unset (free ports are picked)"
        )
    if len(layout.replicas) > 1 and config.api_key is not None and not gateway:
        # Behind the gateway the replicas hold a key of their own and the gateway checks api_key.
        raise ConfigError(
            "SGLangConfig(api_key=...) with several server replicas and gateway=False: clients would reach the "
            "replicas through SGLang's router, which this backend starts without worker keys; keep the "
            "gateway, leave api_key unset, or serve with one replica"
        )
    crowd = max(Counter(gpu for gpus in layout.replicas for gpu in gpus).values(), default=1)
    if crowd < 2 or "mem_fraction_static" not in config.model_fields_set:
        return
    if config.mem_fraction_static * crowd > MAX_SHARED_FRACTION:
        raise ConfigError(
            f"{crowd} server replicas share a GPU, each with mem_fraction_static="
            f"{config.mem_fraction_static}: together more than {MAX_SHARED_FRACTION:.0%} of its memory; set "
            f"mem_fraction_static <= {math.floor(100 * MAX_SHARED_FRACTION / crowd) / 100}, or put the "
            "replicas on different GPUs"
        )


def check_memory_saver(config: SGLangConfig) -> None:
    """Shared mode with "sleep" turns SGLang's memory saver on: not against the user's explicit False."""
    if "enable_memory_saver" in config.model_fields_set and not config.enable_memory_saver:
        raise ConfigError(
            "shared_strategy='sleep' needs SGLangConfig(enable_memory_saver=True) (it was set to False): "
            "leave it unset, or use shared_strategy='restart'"
        )


def check_cluster_sync(config: SGLangConfig) -> None:
    """Replicas on a cluster's nodes get each step as a shipped LoRA adapter."""
    if config.weight_sync_method != "lora":
        raise ConfigError(
            f"weight_sync_method={config.weight_sync_method!r} with cluster=: replicas on other nodes "
            "get each step as a shipped LoRA adapter; use weight_sync_method='lora'"
        )


def pipelining_problem(
    handoff: HandoffStrategy, *, gateway: bool, weight_sync: WeightSyncMethod
) -> str | None:
    """Why a backend set up this way cannot train while rollouts run on older steps, with the fix; None
    when it can."""
    if handoff != "none":
        return (
            f"in shared mode with shared_strategy={handoff!r} the server hands the GPU to the trainer for each "
            "step, so rollouts stop while it trains: use shared_strategy='co_resident' when the server and the "
            "trainer both fit on the GPU, or a second GPU (split mode), or a synchronous loop"
        )
    if not gateway:
        return (
            "with gateway=False nothing checks that a rollout's adapter is still loaded (SGLang answers an "
            "unloaded name from the base model): use gateway=True (the default)"
        )
    if not SYNC_TRAITS[weight_sync].keeps_older_steps:
        return (
            f"weight_sync_method={weight_sync!r} serves only the newest step (older steps' rollouts would "
            "change policy or be cut off mid-request): use weight_sync_method='lora' (the default)"
        )
    return None
