"""GPU discovery (nvidia-smi, no torch import) and the choice of where inference and training run.

GPU indices everywhere in art_sglang are the ones CUDA gives this process: after `CUDA_VISIBLE_DEVICES`,
visible GPUs are numbered 0..n-1. `DeviceLayout.cuda_visible_devices` turns them back into the names a
child process (server, trainer) must be given in its own `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from ..config import ClusterConfig, DeviceConfig
from ..errors import ConfigError

logger = logging.getLogger(__name__)

Mode = Literal["split", "shared", "cpu"]
Engine = Literal["sglang", "reference"]
EngineChoice = Literal["auto", "sglang", "reference"]

QUERY = ["--query-gpu=index,uuid,name,memory.total,memory.used", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 15.0  # a wedged driver can hang nvidia-smi; treat that as no GPU rather than block


@dataclass(frozen=True)
class Gpu:
    """A GPU visible to this process. `index` is CUDA's number for it here; `cuda_id` is how a child's
    `CUDA_VISIBLE_DEVICES` names it (the parent's own entry, or nvidia-smi's index when that is unset)."""

    index: int
    cuda_id: str
    physical_index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int


@dataclass(frozen=True)
class Discovery:
    """What `detect_gpus` found, and in words how (used in log lines and error messages)."""

    gpus: tuple[Gpu, ...]
    detail: str
    cuda_visible_devices: str | None = None  # this process's setting, to name GPUs for children


def detect_gpus(nvidia_smi: str = "nvidia-smi", environ: Mapping[str, str] | None = None) -> Discovery:
    """The GPUs this process may use: nvidia-smi's list filtered and renumbered by `CUDA_VISIBLE_DEVICES`.

    No nvidia-smi, or nvidia-smi failing, means no GPU (the detail says why).
    """
    setting = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    try:
        done = subprocess.run(
            [nvidia_smi, *QUERY], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return Discovery((), f"{nvidia_smi} not found", setting)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Discovery((), f"{nvidia_smi} could not run: {exc}", setting)
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip().splitlines()
        detail = f"{nvidia_smi} failed (exit {done.returncode}): {output[-1] if output else ''}"
        return Discovery((), detail, setting)
    try:
        physical = parse_nvidia_smi(done.stdout)
    except ValueError as exc:
        return Discovery((), f"{nvidia_smi} printed something unexpected: {exc}", setting)
    gpus = apply_cuda_visible_devices(physical, setting)
    where = "CUDA_VISIBLE_DEVICES unset" if setting is None else f"CUDA_VISIBLE_DEVICES={setting!r}"
    return Discovery(gpus, f"{len(physical)} GPU(s) in nvidia-smi, {len(gpus)} visible ({where})", setting)


def parse_nvidia_smi(csv: str) -> tuple[Gpu, ...]:
    """Parse `index, uuid, name, memory.total, memory.used` lines (no header, no units); ValueError
    names a line that does not fit."""
    gpus = []
    for line in csv.splitlines():
        if not line.strip():
            continue
        try:
            # The name may itself contain commas; the fields around it do not.
            index, uuid, rest = (field.strip() for field in line.split(",", 2))
            name, total, used = (field.strip() for field in rest.rsplit(",", 2))
            int(index)
        except ValueError:
            raise ValueError(
                f"not an 'index, uuid, name, memory.total, memory.used' line: {line!r}"
            ) from None
        gpus.append(
            Gpu(
                index=int(index),
                cuda_id=index,
                physical_index=int(index),
                uuid=uuid,
                name=name,
                memory_total_mib=_mib(total),
                memory_used_mib=_mib(used),
            )
        )
    return tuple(gpus)


def _mib(value: str) -> int:
    # nvidia-smi prints "[N/A]" (or "[Not Supported]") for memory it cannot read, e.g. on MIG parents.
    return int(value) if value.isdigit() else 0


def apply_cuda_visible_devices(gpus: Sequence[Gpu], setting: str | None) -> tuple[Gpu, ...]:
    """The GPUs CUDA shows under `setting`, renumbered 0..n-1 in the order listed.

    As CUDA does: entries are indices or UUIDs (a unique prefix is enough); "" hides all GPUs; the first
    entry that names no GPU (e.g. "-1") or repeats one ends the list.
    """
    if setting is None:
        return tuple(gpus)
    visible: list[Gpu] = []
    for entry in (e.strip() for e in setting.split(",")):
        match = _find(gpus, entry)
        if match is None or match in visible:
            break
        visible.append(match)
    return tuple(
        Gpu(
            index=position,
            cuda_id=_entry_for(gpu, setting),
            physical_index=gpu.physical_index,
            uuid=gpu.uuid,
            name=gpu.name,
            memory_total_mib=gpu.memory_total_mib,
            memory_used_mib=gpu.memory_used_mib,
        )
        for position, gpu in enumerate(visible)
    )


def _find(gpus: Sequence[Gpu], entry: str) -> Gpu | None:
    if entry.isdigit():
        return next((g for g in gpus if g.physical_index == int(entry)), None)
    if entry.startswith("GPU-"):
        matches = [g for g in gpus if g.uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None


def _entry_for(gpu: Gpu, setting: str) -> str:
    # Hand children the same kind of name the user wrote (some tools only understand indices).
    return gpu.uuid if "GPU-" in setting else str(gpu.physical_index)


@dataclass(frozen=True)
class DeviceLayout:
    """Where the server and the trainer run.

    split: server and trainer on different GPUs; shared: they take turns on the same GPU(s);
    cpu: the reference engine and the trainer on CPU.
    """

    mode: Mode
    engine: Engine
    inference_gpus: tuple[int, ...]
    training_gpus: tuple[int, ...]
    reason: str
    cuda_ids: tuple[str, ...] = ()  # cuda_ids[i]: how a child names visible GPU i
    # The GPUs of each inference server replica (behind SGLang's router when there are several); empty:
    # one server on `inference_gpus`. On CPU, one empty tuple per reference-engine replica.
    replica_gpus: tuple[tuple[int, ...], ...] = ()

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each inference server (one entry per server)."""
        return self.replica_gpus or (self.inference_gpus,)

    def cuda_visible_devices(self, role: Literal["inference", "training"]) -> str:
        """The `CUDA_VISIBLE_DEVICES` value for the server ("inference") or trainer ("training") process;
        "" in cpu mode, which hides every GPU from it."""
        return self.cuda_names(self.inference_gpus if role == "inference" else self.training_gpus)

    def cuda_names(self, gpus: Sequence[int]) -> str:
        """The `CUDA_VISIBLE_DEVICES` value that shows a child exactly `gpus`."""
        # No ids: nothing detected and no CUDA_VISIBLE_DEVICES, so CUDA's numbering is the physical one.
        return ",".join(self.cuda_ids[i] if self.cuda_ids else str(i) for i in gpus)

    def describe(self) -> str:
        """One line for the log."""
        if self.mode == "cpu":
            replicas = f"{len(self.replicas)} inference replicas" if len(self.replicas) > 1 else "inference"
            where = f"{replicas} and training on CPU"
        elif not any(self.replicas):  # the replicas hold GPUs of other machines (a Ray cluster)
            where = f"inference on other machines, training {_training(self.training_gpus)}"
        elif len(self.replicas) > 1:
            roles = ", ".join(f"replica {n} on GPU {_list(gpus)}" for n, gpus in enumerate(self.replicas))
            where = f"inference {roles} (behind SGLang's router), training {_training(self.training_gpus)}"
        else:
            where = f"inference on GPU {_list(self.inference_gpus)}, training {_training(self.training_gpus)}"
        return f"{self.mode} mode, {self.engine} engine: {where} ({self.reason})"


def _training(gpus: Sequence[int]) -> str:
    if len(gpus) == 1:
        return f"on GPU {gpus[0]}"
    # One data-parallel trainer rank per GPU (training/ranks.py).
    return "ranks " + ", ".join(f"{rank} on GPU {gpu}" for rank, gpu in enumerate(gpus))


def _list(indices: Sequence[int]) -> str:
    return ",".join(str(i) for i in indices)


# The DeviceConfig fields that name GPUs (SGLangBackend takes the same names as arguments).
GPU_FIELDS = ("inference_device", "inference_devices", "training_devices")


def device_request(
    config: DeviceConfig | None, where: str, **gpus: int | list[int] | None
) -> DeviceConfig | None:
    """The one form GPUs are asked for in: `config` with the GPUs that `where` (SGLangBackend's arguments,
    a model's `_internal_config`) names as `DeviceConfig` fields, None for those it leaves unset. A GPU
    field set in both places is a `ConfigError`, as is a value `DeviceConfig` refuses."""
    named = {field: value for field, value in gpus.items() if value is not None}
    if not named:
        return config
    config = config or DeviceConfig()
    both = sorted(config.model_fields_set & set(GPU_FIELDS))
    if both:
        raise ConfigError(
            f"GPUs are set twice: {where} set {', '.join(named)}, and device_config sets "
            f"{', '.join(both)}: set the GPUs in one place"
        )
    try:
        return DeviceConfig(**config.model_dump(include=config.model_fields_set), **named)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {'; '.join(map(_problem, exc.errors()))}") from None


def _problem(error: ErrorDetails) -> str:
    """One pydantic error in words, naming its field (our validators' messages already do)."""
    message, field = error["msg"].removeprefix("Value error, "), ".".join(map(str, error["loc"]))
    return message if message.startswith(field) else f"{field}={error['input']!r}: {message}"


def choose_layout(
    config: DeviceConfig | None = None,
    *,
    engine: EngineChoice = "auto",
    tensor_parallel_size: int = 1,
    discovery: Discovery | None = None,
) -> DeviceLayout:
    """Choose split/shared/cpu from the visible GPUs and what `config` asks (`device_request` makes it).

    `config` fields the user set, or all of them with `auto_detect=False`, win over detection. The server
    takes `tensor_parallel_size` consecutive GPUs from `inference_device`; with `inference_devices` one
    server replica starts at each listed GPU (a GPU listed twice holds two). Settings that cannot work
    raise `ConfigError` naming the fix.
    """
    config = config or DeviceConfig()
    discovery = discovery or detect_gpus()
    trust_config = not config.auto_detect
    named_gpus = bool(set(GPU_FIELDS) & config.model_fields_set)
    inference_devices = config.inference_devices
    inference_device: int | None = None
    if inference_devices is not None:
        if "inference_device" in config.model_fields_set:
            raise ConfigError(
                "both inference_device and inference_devices are set: use inference_devices alone "
                f"(inference_devices=[{config.inference_device}] is one server)"
            )
        if not inference_devices:
            raise ConfigError("inference_devices is empty: list the first GPU of each server replica")
        inference_device = inference_devices[0]
    elif trust_config or "inference_device" in config.model_fields_set:
        inference_device = config.inference_device
    training_devices = None
    if trust_config or "training_devices" in config.model_fields_set:
        training_devices = config.training_devices
    explicit = inference_device is not None or training_devices is not None
    gpus = discovery.gpus
    cuda_ids = _cuda_ids(discovery)

    if engine == "reference":
        if named_gpus:
            raise ConfigError(
                "engine='reference' runs on CPU, but GPUs were set (inference_device/training_devices): "
                "drop them, or use engine='sglang'"
            )
        return DeviceLayout("cpu", "reference", (), (), "engine='reference' requested", cuda_ids)

    if not gpus and not trust_config:
        if engine == "sglang" or explicit:
            asked = "engine='sglang'" if engine == "sglang" else "inference_device/training_devices were set"
            # engine='reference' refuses GPU indices, so running on CPU means leaving out what was asked.
            to_cpu = {
                (True, False): "use engine='reference'",
                (False, True): "leave out inference_device/training_devices",
                (True, True): "use engine='reference' without inference_device/training_devices",
            }[(engine == "sglang", explicit)]
            raise ConfigError(
                f"{asked} but no GPU is visible ({discovery.detail}); check the driver and "
                f"CUDA_VISIBLE_DEVICES, {to_cpu} to run on CPU, or set "
                "DeviceConfig(auto_detect=False, ...) to use the given GPU indices without detection"
            )
        return DeviceLayout("cpu", "reference", (), (), f"no GPU visible: {discovery.detail}", cuda_ids)

    tp = tensor_parallel_size
    if not explicit:
        if len(gpus) < tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} needs {tp} GPUs but {len(gpus)} are visible "
                f"({discovery.detail}); lower tensor_parallel_size"
            )
        serving = tuple(range(tp))
        if len(gpus) > tp:
            rest = tuple(range(tp, len(gpus)))
            return DeviceLayout("split", "sglang", serving, rest, f"{_count(gpus)} visible", cuda_ids)
        reason = f"{_count(gpus)} visible, inference and training take turns"
        return DeviceLayout("shared", "sglang", serving, serving, reason, cuda_ids)

    how = "GPUs set explicitly" if named_gpus else "GPUs from DeviceConfig (auto_detect=False)"
    training = tuple(training_devices) if training_devices is not None else None
    if inference_device is None:
        # Only training GPUs given: serve on the first GPU they leave free.
        free = [g.index for g in gpus if g.index not in (training or ())]
        inference_device = free[0] if free else (training or (0,))[0]
    replicas = _replica_gpus(inference_devices or [inference_device], tp)
    serving = tuple(sorted({gpu for gpus in replicas for gpu in gpus}))
    if training is None:
        training = tuple(g.index for g in gpus if g.index not in serving) or serving
    if not training:
        other = next((g.index for g in gpus if g.index not in serving), serving[-1] + 1)
        raise ConfigError(
            f"training_devices is empty: list at least one GPU for training, e.g. training_devices=[{other}] "
            f"(split mode), or training_devices=[{_list(serving)}] to share the inference GPU"
        )
    # Without detection (auto_detect=False, nothing found) this process's CUDA_VISIBLE_DEVICES, if set,
    # still bounds the indices.
    known = len(gpus) if gpus else len(cuda_ids)
    missing = sorted(i for i in {*serving, *training} if known and i >= known)
    if missing:
        listing = (
            f"{_count(gpus)} visible"
            if gpus
            else f"CUDA_VISIBLE_DEVICES={discovery.cuda_visible_devices!r} shows {known}"
        )
        raise ConfigError(
            f"GPU {_list(missing)} does not exist: {listing}, numbered 0..{known - 1} "
            f"({discovery.detail}); use indices in that range (they count only the GPUs "
            "CUDA_VISIBLE_DEVICES shows)"
        )
    several = replicas if len(replicas) > 1 else ()
    if set(training) == set(serving):
        if several:
            raise ConfigError(
                f"inference_devices={list(inference_devices or ())} starts {len(replicas)} server replicas on "
                f"the training GPU(s) {_list(training)}: replicas need split mode, give training its own "
                "GPU(s) in training_devices"
            )
        return DeviceLayout("shared", "sglang", serving, training, f"{how}, the same for both", cuda_ids)
    overlap = sorted(set(training) & set(serving))
    if overlap:
        raise ConfigError(
            f"GPU {_list(overlap)} is set for both inference (GPU {_list(serving)}) and training "
            f"(GPU {_list(training)}); in split mode they must be different GPUs: remove it from "
            f"training_devices, or set training_devices=[{_list(serving)}] for shared mode"
        )
    return DeviceLayout("split", "sglang", serving, training, how, cuda_ids, several)


def _replica_gpus(firsts: Sequence[int], tp: int) -> tuple[tuple[int, ...], ...]:
    """Each replica's `tp` consecutive GPUs from its first; replicas share all their GPUs or none."""
    replicas = tuple(tuple(range(first, first + tp)) for first in firsts)
    for n, gpus in enumerate(replicas):
        for other in replicas[:n]:
            if gpus != other and set(gpus) & set(other):
                raise ConfigError(
                    f"server replicas on GPU {_list(other)} and GPU {_list(gpus)} (tensor_parallel_size={tp}) "
                    f"partly overlap: start replicas {tp} GPUs apart, or at the same GPU to share it"
                )
    return replicas


def _cuda_ids(discovery: Discovery) -> tuple[str, ...]:
    if discovery.gpus:
        return tuple(g.cuda_id for g in discovery.gpus)
    # Nothing detected but GPUs trusted from the config: children index into this process's own list.
    setting = discovery.cuda_visible_devices
    return tuple(e.strip() for e in setting.split(",")) if setting else ()


def _count(gpus: Sequence[Gpu]) -> str:
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)} GPU(s) ({', '.join(names)})"


def cluster_layout(
    cluster: ClusterConfig, engine: EngineChoice, tensor_parallel_size: int, found: Discovery
) -> DeviceLayout:
    """The head's layout: every GPU of this machine trains (`found`), the inference replicas hold GPUs of
    the cluster's nodes (none here). The engine follows this machine's GPUs unless `engine` names one."""
    require_ray()
    chosen = engine if engine != "auto" else ("sglang" if found.gpus else "reference")
    if chosen == "sglang" and cluster.gpus_per_replica < tensor_parallel_size:
        raise ConfigError(
            f"ClusterConfig(gpus_per_replica={cluster.gpus_per_replica:g}) is below tensor_parallel_size="
            f"{tensor_parallel_size}: each SGLang replica needs that many GPUs"
        )
    gpus = tuple(gpu.index for gpu in found.gpus) if chosen == "sglang" else ()
    where = f"{cluster.inference_replicas} inference replica(s) on the Ray cluster at {cluster.address!r}"
    return DeviceLayout(
        "split" if gpus else "cpu",
        chosen,
        (),
        gpus,
        f"{where}; this machine trains",
        tuple(gpu.cuda_id for gpu in found.gpus),
        replica_gpus=((),) * cluster.inference_replicas,
    )


def require_ray() -> None:
    """A `ConfigError` naming the extra to install where Ray is missing (looked up, not imported)."""
    try:
        installed = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: a `ray` module without a spec (or blocked, None)
        installed = False
    if not installed:
        raise ConfigError(
            "cluster= runs the inference replicas as Ray actors, and Ray is not installed in this "
            "environment: pip install -e '.[ray]' in the art_sglang checkout"
        )
