"""From what was asked to the frozen `ServingPlan`, without side effects: `settle` chooses the device layout
and the server's settings from a `BackendRequest` and the first model's `_internal_config` (before a model,
what SGLangBackend shows and refuses when it is made); `make_plan` adds the memory plan of a shared GPU
and the replicas, once, at the first registration. What they need from the machine (the GPUs found, the
base model's size, whether CUDA MPS can start) is passed in; the checks they run live in `config_checks`."""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from ..config import SGLangConfig, TrainerConfig
from ..cuda_mps import CONTROL
from ..errors import ConfigError
from .config_checks import (
    check_cluster_sync,
    check_compatible,
    check_cuda_mps,
    check_memory_saver,
    check_merged_push,
    check_model_gpus,
    check_replicas,
)
from .devices import DeviceLayout, Discovery, choose_layout, cluster_layout, device_request
from .gpu_budget import SharedPlan, plan_co_resident, plan_shared_gpu
from .internal_config import ModelSettings
from .request import BackendRequest
from .serving_plan import FrozenSGLangConfig, HandoffStrategy, ReplicaPlan, ServingPlan, frozen_config

logger = logging.getLogger(__name__)

# Replicas sharing a GPU split this share of it equally by default (at most `config_checks`'
# MAX_SHARED_FRACTION).
DEFAULT_SHARED_FRACTION = 0.85


@dataclass(frozen=True)
class Settled:
    """The layout and server settings before a shared GPU's memory plan."""

    layout: DeviceLayout
    requested_config: SGLangConfig  # as the user and the first model asked (later models must match)
    server_config: SGLangConfig  # fitted to the layout: replicas' shares, shared mode's memory saver
    handoff: HandoffStrategy
    co_resident: bool  # one GPU for both, no handoff: the server serves while the trainer trains
    cuda_mps: bool  # the co-resident server and trainer share the GPU through CUDA MPS

    def describe(self) -> str:
        """The layout, the weight sync and in shared mode the strategy, in words."""
        strategy = "co_resident" if self.co_resident else self.handoff
        shared = f", shared strategy {strategy!r}" if self.layout.mode == "shared" else ""
        return f"{self.layout.describe()}; weight sync {self.server_config.weight_sync_method!r}{shared}"


def settle(
    request: BackendRequest,
    first: ModelSettings | None,
    gpus: Discovery,
    *,
    template_file: str | None = None,
    mps_found: bool = False,
) -> Settled:
    """The layout and server settings for `request` and the first model's settings (`template_file`: where
    a template given as text is written; `mps_found`: the driver's MPS control program is on PATH)."""
    config, trainer = request.sglang, request.trainer
    if first is not None:  # its _internal_config may choose the server's flags and the GPUs
        config = config.model_copy(update=server_updates(first, template_file))
        # Validated again with only the fields set, so settings the user left alone stay defaults.
        config = SGLangConfig.model_validate(config.model_dump(exclude_unset=True))
        trainer = first.trainer
    tp = config.tensor_parallel_size
    if first is not None and first.inference_gpu_ids is not None and first.trainer_gpu_ids is not None:
        check_model_gpus(
            first.inference_gpu_ids, devices_given=request.devices_given, tensor_parallel_size=tp
        )
        where = "_internal_config trainer_gpu_ids/inference_gpu_ids"
        devices = device_request(
            request.devices,
            where,
            inference_device=first.inference_gpu_ids[0],
            training_devices=first.trainer_gpu_ids,
        )
        try:
            layout = choose_layout(devices, engine=request.engine, tensor_parallel_size=tp, discovery=gpus)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    elif request.layout is not None:
        layout = request.layout
    elif request.cluster is not None:
        layout = cluster_layout(request.cluster, request.engine, tp, gpus)
    else:
        layout = choose_layout(
            request.devices, engine=request.engine, tensor_parallel_size=tp, discovery=gpus
        )
    requested = serve_trained(config, trainer)
    strategy = request.shared_strategy
    handoff: HandoffStrategy = strategy if layout.mode == "shared" and strategy != "co_resident" else "none"
    check_replicas(requested, layout, gateway=request.gateway)
    fitted = fit_replicas(requested, layout)
    if handoff == "sleep":
        check_memory_saver(fitted)
        fitted = with_memory_saver(fitted)
    check_compatible(fitted, trainer)
    co_resident = layout.mode == "shared" and strategy == "co_resident"
    mps_applies = co_resident and layout.engine == "sglang"
    check_cuda_mps(request.cuda_mps, co_resident_sglang=mps_applies, found=mps_found)
    cuda_mps = mps_applies and mps_found and request.cuda_mps != "off"
    return Settled(layout, requested, fitted, handoff, co_resident, cuda_mps)


def make_plan(
    request: BackendRequest,
    first: ModelSettings | None,
    gpus: Discovery,
    *,
    template_file: str | None = None,
    weights_bytes: int | None = None,
    mps_found: bool = False,
) -> ServingPlan:
    """The frozen plan for serving the first model (`weights_bytes`: its base model's weight files, None
    when unknown; see `settle` for the rest)."""
    settled = settle(request, first, gpus, template_file=template_file, mps_found=mps_found)
    layout, config = settled.layout, settled.server_config
    if request.cluster is not None:
        check_cluster_sync(config)
    check_merged_push(config, layout)
    release: Literal["kv_cache", "all"] = "all"
    total = _gpu_total_bytes(layout, gpus)
    if settled.handoff == "sleep":
        shared = _shared_plan(config, layout, total, weights_bytes)
        config = config.model_copy(update={"mem_fraction_static": shared.mem_fraction_static})
        release = shared.release
        logger.info(
            "shared mode: each step releases the server's %s%s (mem_fraction_static %.3f): %s",
            "KV cache; the trainer keeps its model on the GPU" if shared.trainer_resident else "weights",
            "" if shared.trainer_resident else " and KV cache; the trainer moves to host memory",
            shared.mem_fraction_static,
            shared.reason,
        )
    elif settled.co_resident:  # no handoff: the server's pool leaves the trainer room
        if total is None and layout.engine == "sglang":
            raise ConfigError(
                "shared_strategy='co_resident' needs the GPU's memory size (nvidia-smi did not report it) to "
                "leave room for the trainer: use shared_strategy='sleep'"
            )
        fraction = plan_co_resident(
            gpu_total_bytes=total,
            weights_bytes=weights_bytes,
            mem_fraction_static=config.mem_fraction_static,
            fraction_set_by_user="mem_fraction_static" in config.model_fields_set,
        )
        config = config.model_copy(update={"mem_fraction_static": fraction})
        logger.info(
            "shared mode, co-resident: server and trainer stay on the GPU (mem_fraction_static %.3f)",
            fraction,
        )
        if layout.engine == "sglang" and not settled.cuda_mps and request.cuda_mps == "auto":
            logger.info(
                "co-resident without CUDA MPS (%s is not on PATH): server and trainer take turns on the GPU",
                CONTROL,
            )
    frozen = frozen_config(config)
    return ServingPlan(
        layout=layout,
        server_config=frozen,
        requested_config=frozen_config(settled.requested_config),
        replicas=_replicas(layout, frozen),
        training_gpu_ids=tuple(_gpu_ids(layout, layout.training_gpus)),
        handoff=settled.handoff,
        release=release,
        cuda_mps=settled.cuda_mps,
        weight_sync=config.weight_sync_method,
        cluster=request.cluster,
    )


def _shared_plan(
    config: SGLangConfig, layout: DeviceLayout, total: int | None, weights_bytes: int | None
) -> SharedPlan:
    """What a sleep handoff releases, from the shared GPU's size and the base model's."""
    requested = config.sleep_release
    if total is None and layout.engine == "sglang" and requested == "auto":
        return SharedPlan("all", config.mem_fraction_static, "the GPU's memory size is unknown")
    return plan_shared_gpu(
        requested,
        gpu_total_bytes=total,
        weights_bytes=weights_bytes,
        mem_fraction_static=config.mem_fraction_static,
        fraction_set_by_user="mem_fraction_static" in config.model_fields_set,
    )


def server_updates(settings: ModelSettings, template_file: str | None) -> dict[str, Any]:
    """SGLangConfig fields from a model's settings; a template given as text goes to `template_file`, which
    the server reads (SGLang's --chat-template takes a path)."""
    updates = dict(settings.server_updates)
    if settings.chat_template_path is not None:
        updates["chat_template"] = settings.chat_template_path
    elif settings.chat_template is not None:
        updates["chat_template"] = template_file
    return updates


def fit_replicas(config: SGLangConfig, layout: DeviceLayout) -> SGLangConfig:
    """Server replicas sharing a GPU split its memory: mem_fraction_static defaults to an equal share
    (`check_replicas` refuses what cannot work)."""
    shares = Counter(gpu for gpus in layout.replicas for gpu in gpus)
    crowd = max(shares.values(), default=1)
    if crowd < 2 or "mem_fraction_static" in config.model_fields_set:
        return config
    share = math.floor(100 * DEFAULT_SHARED_FRACTION / crowd) / 100
    return config.model_copy(update={"mem_fraction_static": share})


def serve_trained(config: SGLangConfig, trainer: TrainerConfig) -> SGLangConfig:
    """Unless `lora_target_modules` was given, the server adapts exactly the modules the trainer trains: a
    LoRA kernel on a module no adapter has weights for (lm_head, embed_tokens under 'all') costs every
    decode step and changes nothing. Likewise its LoRA pool holds the trainer's rank unless `max_lora_rank`
    was given: a wider pool takes memory, and every LoRA kernel computes over its width. An unset
    `lora_experimental_path` is settled here: on where the triton pool holds exactly the trainer's rank."""
    updates: dict[str, Any] = {}
    if config.lora_target_modules is None:
        updates["lora_target_modules"] = list(trainer.target_modules)
    if config.max_lora_rank is None:
        updates["max_lora_rank"] = trainer.lora_rank
    if config.lora_experimental_path is None:
        updates["lora_experimental_path"] = experimental_path_runs(
            config.lora_backend, config.max_lora_rank, trainer.lora_rank
        )
    return config.model_copy(update=updates)


def experimental_path_runs(lora_backend: str | None, max_lora_rank: int | None, lora_rank: int) -> bool:
    """Where SGLang 0.5.17's experimental LoRA path can serve adapters of `lora_rank`: the triton kernels, and
    a pool of exactly that rank (`max_lora_rank` unset: the trainer's), since it computes NaN for a narrower
    adapter."""
    return lora_backend == "triton" and max_lora_rank in (None, lora_rank)


def with_memory_saver(config: SGLangConfig) -> SGLangConfig:
    """Shared mode with "sleep" needs SGLang's memory saver and CPU weight backup: without them
    release_memory_occupation answers 200 and frees nothing (`check_memory_saver`)."""
    return config.model_copy(update={"enable_memory_saver": True, "enable_weights_cpu_backup": True})


def _replicas(layout: DeviceLayout, config: FrozenSGLangConfig) -> tuple[ReplicaPlan, ...]:
    crowds = Counter(gpus for gpus in layout.replicas)
    plans = []
    for gpus in layout.replicas:
        if layout.engine == "reference" or not gpus:
            plans.append(ReplicaPlan(gpu_ids=(), configs=(config,)))  # without GPUs nothing is shared
            continue
        f = config.mem_fraction_static
        beside = [
            config.model_copy(update={"mem_fraction_static": round(f / (1 - k * f), 3)})
            for k in range(1, crowds[gpus])
        ]
        plans.append(ReplicaPlan(gpu_ids=tuple(_gpu_ids(layout, gpus)), configs=(config, *beside)))
    return tuple(plans)


def _gpu_ids(layout: DeviceLayout, gpus: tuple[int, ...]) -> list[str]:
    """GPU ids (indices or UUIDs, as the user's CUDA_VISIBLE_DEVICES names them) for a child's
    CUDA_VISIBLE_DEVICES: none on CPU (hides every GPU)."""
    if layout.engine == "reference":
        return []
    return [part for part in layout.cuda_names(gpus).split(",") if part]


def _gpu_total_bytes(layout: DeviceLayout, gpus: Discovery) -> int | None:
    """The shared GPU's memory; None on the reference engine or when nvidia-smi does not list it."""
    if layout.engine != "sglang" or not layout.inference_gpus:
        return None
    found = {gpu.index: gpu for gpu in gpus.gpus}.get(layout.inference_gpus[0])
    return found.memory_total_mib * 2**20 if found is not None else None
