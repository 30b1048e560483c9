"""Where configuration is validated: the checks of settings against each other (SGLangBackend's arguments,
server and trainer, the replicas and their GPUs, shared mode, CUDA MPS, a cluster, each model's
`_internal_config` against the backend's, a train() call's options, pipelining), each raising a
`ConfigError` that names the fix, before anything starts. A single field is checked where it is declared
(`config.py`, `training/options.py`); the GPUs asked for, where the layout is chosen (`devices.py`)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ..config import DeviceConfig, SGLangConfig, TrainerConfig, WeightSyncMethod
from ..cuda_mps import CONTROL
from ..errors import ConfigError
from ..storage.model_store import base_model_problem
from ..training.options import TrainOptions
from .devices import DeviceLayout
from .internal_config import ModelSettings
from .serving_plan import SYNC_TRAITS, HandoffStrategy, ServingPlan

# Replicas sharing a GPU hold at most this share of it for weights and KV cache together. Each server also
# needs memory outside that share (CUDA context, activations, LoRA buffers): on an H200 two replicas of
# 0.45 each held 97 % of it (measured).
MAX_SHARED_FRACTION = 0.9


def check_request(
    sglang: SGLangConfig,
    trainer: TrainerConfig,
    *,
    shared_strategy: str,
    cuda_mps: str,
    engine: str,
    layout: DeviceLayout | None,
    devices: DeviceConfig | None,
    cluster: bool,
) -> None:
    """SGLangBackend's arguments, checked against each other when it is made."""
    if shared_strategy not in ("sleep", "restart", "co_resident"):
        raise ConfigError(f"shared_strategy={shared_strategy!r}: use 'sleep', 'restart' or 'co_resident'")
    if cuda_mps not in ("auto", "on", "off"):
        raise ConfigError(f"cuda_mps={cuda_mps!r}: use 'auto', 'on' or 'off'")
    if engine not in ("auto", "sglang", "reference"):
        raise ConfigError(f"engine={engine!r}: use 'auto', 'sglang' or 'reference'")
    check_compatible(sglang, trainer)
    if layout is not None and (devices is not None or engine not in ("auto", layout.engine)):
        raise ConfigError(
            "layout= is a finished device layout: give it alone, without device_config, GPU arguments "
            "or another engine"
        )
    if cluster and (layout is not None or devices is not None):
        raise ConfigError(
            "cluster= places the inference replicas on the Ray cluster's nodes and trains on this "
            "machine's GPUs: drop inference_device(s)/training_devices/device_config/layout"
        )


def check_compatible(sglang: SGLangConfig, trainer: TrainerConfig) -> None:
    """Configuration clashes between server and trainer, found before anything starts."""
    if sglang.weight_sync_method == "merged" and trainer.load_in_4bit:
        raise ConfigError(
            "weight_sync_method='merged' serves the bf16 base plus the adapter, merged by the trainer; a "
            "4-bit trainer base is not the server's base: set load_in_4bit=False or weight_sync_method='lora'"
        )
    # Unset, the pool takes the (first) trainer's rank (`serve_trained`).
    if sglang.max_lora_rank is not None and trainer.lora_rank > sglang.max_lora_rank:
        raise ConfigError(
            f"TrainerConfig(lora_rank={trainer.lora_rank}) exceeds SGLangConfig(max_lora_rank="
            f"{sglang.max_lora_rank}): the server could not load the adapters; raise max_lora_rank to "
            f"{trainer.lora_rank} (unset, it is the first model's lora_rank) or lower lora_rank"
        )
    check_experimental_lora(sglang, trainer)
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


def check_experimental_lora(sglang: SGLangConfig, trainer: TrainerConfig) -> None:
    """SGLang 0.5.17's experimental LoRA path runs the triton backend's kernels, and computes garbage (NaN) for
    an adapter of a rank below the pool's: its shrink writes the adapter's rank of columns, its expand reads
    max_lora_rank of them."""
    if not sglang.experimental_lora_served:  # off, unset (a plan settles it where it runs) or merged weights
        return
    if sglang.lora_backend != "triton":
        raise ConfigError(
            f"SGLangConfig(lora_experimental_path=True) runs SGLang 0.5.17's experimental triton LoRA kernels, "
            f"not lora_backend={sglang.lora_backend!r}: set lora_backend='triton', or lora_experimental_path=False"
        )
    if sglang.max_lora_rank is not None and sglang.max_lora_rank != trainer.lora_rank:
        raise ConfigError(
            f"SGLangConfig(lora_experimental_path=True) serves adapters of the LoRA pool's rank only (SGLang "
            f"0.5.17's experimental path computes NaN for another), and TrainerConfig(lora_rank="
            f"{trainer.lora_rank}) is not max_lora_rank={sglang.max_lora_rank}: leave max_lora_rank unset (the "
            "first model's lora_rank) and give every model that rank, or set lora_experimental_path=False"
        )


def check_new_model(model: Any, registered: list[tuple[str, str]]) -> None:
    """A model a backend can take beside the `registered` ones ((project, name) each)."""
    problem = base_model_problem(model.base_model)
    if problem is not None:
        raise ConfigError(f"model {model.name!r}: {problem}")
    for project, name in registered:
        if name == model.name and project != model.project:
            # Adapters are served as <name>@<step>: two projects' models of one name would share them.
            raise ConfigError(
                f"a model named {model.name!r} (project {project!r}) is already registered on this "
                f"backend, and served adapter names are <name>@<step>: give the model of project "
                f"{model.project!r} another name, or use a second SGLangBackend"
            )


def check_model_gpus(inference: list[int], *, devices_given: bool, tensor_parallel_size: int) -> None:
    """The first model's `_internal_config` GPUs (`devices_given`: SGLangBackend settled them already)."""
    if devices_given:
        raise ConfigError(
            "_internal_config sets trainer_gpu_ids/inference_gpu_ids, and SGLangBackend was given its "
            "devices too: set the GPUs in one place"
        )
    if len(inference) != tensor_parallel_size:
        raise ConfigError(
            f"_internal_config inference_gpu_ids={inference} must list tensor_parallel_size="
            f"{tensor_parallel_size} GPU(s) (consecutive, from the first)"
        )


def check_same_server(model: Any, settings: ModelSettings, plan: ServingPlan, served_base_model: str) -> None:
    """A later model shares the running server: it may not ask for different server settings."""
    if served_base_model != model.base_model:
        raise ConfigError(
            f"this backend serves base model {served_base_model!r}; model {model.name!r} uses "
            f"{model.base_model!r}: one server serves one base model, so use a second SGLangBackend"
        )
    if not SYNC_TRAITS[plan.weight_sync].several_models:
        raise ConfigError(
            f"weight_sync_method={plan.weight_sync!r} merges one model's weights into the server's base "
            "weights, so only one model can be registered: use weight_sync_method='lora' to serve several"
        )
    different: dict[str, Any] = {
        key: value
        for key, value in settings.server_updates.items()
        if getattr(plan.requested_config, key) != value
    }
    if settings.chat_template is not None:
        different["chat_template"] = "(the model's own template)"
    if settings.inference_gpu_ids is not None:
        different["inference_gpu_ids"] = settings.inference_gpu_ids
    if different:
        raise ConfigError(
            f"model {model.name!r} asks for server settings {different} in _internal_config, but this "
            "backend's server already runs for another model: one server serves every model of a "
            "backend, so use a second SGLangBackend"
        )
    check_compatible(plan.server_config, settings.trainer)


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


def check_cuda_mps(mode: str, *, co_resident_sglang: bool, found: bool) -> None:
    """cuda_mps='on' where it cannot apply (`co_resident_sglang`: server and trainer share a GPU at once
    on SGLang; `found`: the driver's MPS control program is on PATH)."""
    if mode != "on":
        return
    if not co_resident_sglang:
        raise ConfigError(
            "cuda_mps='on' applies to shared_strategy='co_resident' on SGLang (server and trainer on "
            "one GPU at once): use cuda_mps='auto' or 'off'"
        )
    if not found:
        raise ConfigError(f"cuda_mps='on' needs {CONTROL} (part of the NVIDIA driver) on PATH")


def check_cluster_sync(config: SGLangConfig) -> None:
    """Replicas on a cluster's nodes get each step as a shipped LoRA adapter, or as merged weights over a
    weight-update group that meets at this machine's address."""
    if config.weight_sync_method not in ("lora", "merged"):
        raise ConfigError(
            f"weight_sync_method={config.weight_sync_method!r} with cluster=: replicas on other nodes "
            "get each step as a shipped LoRA adapter or as merged weights over the network; use "
            "weight_sync_method='lora' or 'merged'"
        )


def check_merged_push(config: SGLangConfig, layout: DeviceLayout) -> None:
    """Merged weights reach SGLang servers as CUDA IPC handles where one server shares the trainer's one
    GPU, else over a weight-update group (NCCL: split mode, replicas, several training GPUs; rank 0 sends).
    Shared mode on several GPUs or with replicas has neither (the servers' ranks sit on the trainer's GPUs),
    nor do replicas that share a GPU."""
    if config.weight_sync_method != "merged" or layout.engine != "sglang":
        return
    if layout.mode == "shared" and (len(layout.training_gpus) > 1 or len(layout.replicas) > 1):
        raise ConfigError(
            "weight_sync_method='merged' in shared mode on several GPUs or with several server replicas: the "
            "servers' ranks share the trainer's GPUs, where NCCL cannot join a second rank and the CUDA IPC "
            "push is built for one server on one GPU; use split mode (training_devices apart from the "
            "inference GPUs), one GPU, or weight_sync_method='lora'"
        )
    gpus = [gpu for replica in layout.replicas for gpu in replica]
    if len(gpus) != len(set(gpus)):
        raise ConfigError(
            "weight_sync_method='merged' with server replicas sharing a GPU: merged weights reach replicas "
            "over one NCCL group, which cannot hold two ranks on one GPU; give each replica GPUs of its own "
            "(inference_devices), or use weight_sync_method='lora'"
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
    traits = SYNC_TRAITS[weight_sync]
    if not (traits.keeps_older_steps or traits.updates_in_flight):
        return (
            f"weight_sync_method={weight_sync!r} serves only the newest step (older steps' rollouts would "
            "change policy or be cut off mid-request): use weight_sync_method='lora' (the default) or "
            "'merged'"
        )
    return None
