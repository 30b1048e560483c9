"""What shared mode gives the trainer at each step, decided once per backend from measured sizes.

LoRA training never changes the base weights, so when the server's copy of them and the trainer's copy
both fit on the one GPU, the server releases only its KV cache for a step (SGLang 0.5.17 on an H100: 0.04 s
to release, 0.02 s to resume, outputs identical) and the trainer keeps its model on the GPU. When they do
not fit, the server releases its weights too (copied to host memory: seconds for a multi-GB model) and the
trainer moves its model to host memory between steps.

With shared_strategy "co_resident" nothing is released: both stay on the GPU and serve/train at the same
time (pipelined training), the server's pool sized by `plan_co_resident`.

Room for the trainer's resident copy comes from the server's static pool (`mem_fraction_static`): SGLang
sizes its KV cache from that fraction of the memory free when it starts, so a fraction that leaves the
trainer's copy outside the pool is safe whichever process loads first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import SleepRelease
from ..errors import ConfigError

GIB = 2**30
# Beyond its base weights the trainer holds the CUDA context, LoRA weights, AdamW moments and the
# allocator's cached blocks between steps; 2 GiB covered them at 1.5B and 7B shapes with r=16.
TRAINER_OVERHEAD_BYTES = 2 * GIB
# SGLang's own default fraction (0.9) leaves a tenth of the GPU for activations and CUDA graphs outside
# its static pool; the same headroom is kept when the pool is shrunk for the trainer.
SERVER_HEADROOM_FRACTION = 0.1
# A KV cache smaller than this share of the GPU would starve rollouts; below it, weights are released too.
MIN_KV_FRACTION = 0.1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class SharedPlan:
    """The release policy chosen for shared mode, the server's static memory fraction, and why."""

    release: Literal["kv_cache", "all"]
    mem_fraction_static: float
    reason: str

    @property
    def trainer_resident(self) -> bool:
        """Whether the trainer keeps its model on the GPU between steps."""
        return self.release == "kv_cache"


def plan_shared_gpu(
    requested: SleepRelease,
    *,
    gpu_total_bytes: int | None,
    weights_bytes: int | None,
    mem_fraction_static: float,
    fraction_set_by_user: bool,
) -> SharedPlan:
    """Choose what a sleep handoff releases. `gpu_total_bytes` None means no GPU (the reference engine on
    CPU, where memory is not the constraint). `ConfigError` when "kv_cache" is asked for and cannot fit."""
    if requested == "all":
        return SharedPlan("all", mem_fraction_static, "sleep_release='all' was asked for")
    if gpu_total_bytes is None:
        return SharedPlan("kv_cache", mem_fraction_static, "no GPU: nothing competes for its memory")
    if weights_bytes is None:
        if requested == "kv_cache" and not fraction_set_by_user:
            raise ConfigError(
                "sleep_release='kv_cache' needs the base model's size to leave room for the trainer, and "
                "its weight files were not found locally: set SGLangConfig(mem_fraction_static=...) so "
                "that the rest of the GPU holds the trainer's copy of the model, or use sleep_release='all'"
            )
        if requested == "auto":
            return SharedPlan("all", mem_fraction_static, "the base model's size is unknown (no local files)")
    resident = (weights_bytes or 0) + TRAINER_OVERHEAD_BYTES
    fits = 1.0 - SERVER_HEADROOM_FRACTION - resident / gpu_total_bytes
    if fraction_set_by_user:
        fraction = mem_fraction_static
        outside = gpu_total_bytes * (1.0 - fraction)
        if weights_bytes is not None and outside < resident:
            if requested == "kv_cache":
                raise ConfigError(
                    f"sleep_release='kv_cache' keeps the trainer's copy of the model ({resident / GIB:.1f} "
                    f"GiB) on the GPU, but mem_fraction_static={fraction} leaves {outside / GIB:.1f} GiB "
                    f"outside the server's pool: lower it to {max(fits, 0.05):.2f} or use sleep_release='all'"
                )
            return SharedPlan(
                "all", fraction, f"mem_fraction_static={fraction} leaves no room for the trainer"
            )
        return SharedPlan("kv_cache", fraction, "the trainer's copy fits outside the configured pool")
    fraction = min(mem_fraction_static, math.floor(fits * 1000) / 1000)
    kv_share = fraction - (weights_bytes or 0) / gpu_total_bytes
    if kv_share < MIN_KV_FRACTION:
        if requested == "kv_cache":
            raise ConfigError(
                f"sleep_release='kv_cache' does not fit: two copies of a {(weights_bytes or 0) / GIB:.1f} GiB "
                f"model on a {gpu_total_bytes / GIB:.0f} GiB GPU leave {max(kv_share, 0) * 100:.0f}% for the "
                "KV cache; use sleep_release='all'"
            )
        return SharedPlan(
            "all",
            mem_fraction_static,
            f"two copies of the weights leave {max(kv_share, 0) * 100:.0f}% of the GPU for the KV cache",
        )
    return SharedPlan(
        "kv_cache",
        fraction,
        f"server and trainer copies of the weights ({(weights_bytes or 0) / GIB:.1f} GiB each) fit with "
        f"{kv_share * 100:.0f}% of the GPU for the KV cache",
    )


def plan_co_resident(
    *,
    gpu_total_bytes: int | None,
    weights_bytes: int | None,
    mem_fraction_static: float,
    fraction_set_by_user: bool,
) -> float:
    """The server's static memory fraction when server and trainer share one GPU with no handoff at all
    (shared_strategy "co_resident"): the trainer's copy of the model stays outside the server's pool, and
    what is left besides the headroom is split evenly between the server's KV cache and the trainer's
    activations (the trainer never gets the KV cache's memory, as it does in a sleep handoff).
    `ConfigError` when that leaves either too little."""
    if gpu_total_bytes is None:
        return mem_fraction_static  # no GPU: nothing competes for its memory
    if weights_bytes is None and not fraction_set_by_user:
        raise ConfigError(
            "shared_strategy='co_resident' needs the base model's size to leave room for the trainer, and "
            "its weight files were not found locally: set SGLangConfig(mem_fraction_static=...) so that the "
            "rest of the GPU holds the trainer's model and activations"
        )
    weights = (weights_bytes or 0) / gpu_total_bytes
    resident = weights + TRAINER_OVERHEAD_BYTES / gpu_total_bytes
    free = 1.0 - SERVER_HEADROOM_FRACTION - resident - weights  # besides both copies and the headroom
    if fraction_set_by_user:
        fraction = mem_fraction_static
        trainer_share = 1.0 - SERVER_HEADROOM_FRACTION - fraction - resident
    else:
        fraction = min(mem_fraction_static, math.floor((weights + free / 2) * 1000) / 1000)
        trainer_share = free / 2
    if fraction - weights < MIN_KV_FRACTION or trainer_share < MIN_KV_FRACTION:
        raise ConfigError(
            f"shared_strategy='co_resident' does not fit: a {(weights_bytes or 0) / GIB:.1f} GiB model twice "
            f"on a {gpu_total_bytes / GIB:.0f} GiB GPU with mem_fraction_static={fraction:.3f} leaves "
            f"{max(fraction - weights, 0) * 100:.0f}% of the GPU for the server's KV cache and "
            f"{max(trainer_share, 0) * 100:.0f}% for training (each needs {MIN_KV_FRACTION * 100:.0f}%): "
            "use shared_strategy='sleep' (server and trainer take turns), or a second GPU (split mode)"
        )
    return fraction


def model_weights_bytes(model: str) -> int | None:
    """Bytes of a model's weight files: a local directory, or the Hugging Face cache's snapshot of a hub
    name (no download). None when neither has them."""
    folder = Path(model)
    if not folder.is_dir():
        folder = _cached_snapshot(model)
        if folder is None:
            return None
    total = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    if total == 0:
        return None
    # A checkpoint saved with both formats would be counted twice; the safetensors files alone load.
    safetensors = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return safetensors or total


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not a repo id, not cached, or huggingface_hub missing: the size is unknown
        return None
