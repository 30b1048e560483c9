"""The backend's device layout and server configuration as the user asked: chosen from SGLangBackend's
arguments, changed by the first model's `_internal_config` if it asks, then fixed (a later model may not
ask for other server settings: one server serves every model of a backend); `serving_plan.make_plan`
turns them into the frozen plan. Its checks of settings against each other live in `config_checks`."""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Literal

from ..config import ClusterConfig, CudaMpsMode, DeviceConfig, SGLangConfig, SharedStrategy, TrainerConfig
from ..cuda_mps import CONTROL, control_program
from ..errors import ConfigError
from ..storage.model_store import ModelStore, base_model_problem
from .config_checks import check_cluster_sync, check_compatible, check_memory_saver, check_replicas
from .devices import (
    GPU_FIELDS,
    DeviceLayout,
    EngineChoice,
    choose_layout,
    cluster_layout,
    detect_gpus,
    device_request,
)
from .gpu_budget import SharedPlan, model_weights_bytes, plan_co_resident, plan_shared_gpu
from .internal_config import ModelSettings, internal_config_of, model_settings
from .serving_plan import (
    SYNC_TRAITS,
    FrozenSGLangConfig,
    HandoffStrategy,
    ReplicaPlan,
    ServingPlan,
    frozen_config,
)

logger = logging.getLogger(__name__)

# Replicas sharing a GPU split this share of it equally by default (at most `config_checks`'
# MAX_SHARED_FRACTION).
DEFAULT_SHARED_FRACTION = 0.85


class BackendSettings:
    """`layout`, `sglang_config` and the `handoff_strategy` that follows from them."""

    def __init__(
        self,
        config: SGLangConfig,
        trainer_config: TrainerConfig,
        *,
        shared_strategy: SharedStrategy = "sleep",
        device_config: DeviceConfig | None = None,
        engine: EngineChoice = "auto",
        layout: DeviceLayout | None = None,
        cuda_mps: CudaMpsMode = "auto",
        cluster: ClusterConfig | str | None = None,
        gateway: bool = True,
    ) -> None:
        """`device_config`: the GPUs asked for (`device_request` turns SGLangBackend's GPU arguments into
        one); `layout`: a finished layout instead (tests force shared mode on CPU with it); `gateway`: clients
        reach the servers through the adapter gateway."""
        if shared_strategy not in ("sleep", "restart", "co_resident"):
            raise ConfigError(f"shared_strategy={shared_strategy!r}: use 'sleep', 'restart' or 'co_resident'")
        if cuda_mps not in ("auto", "on", "off"):
            raise ConfigError(f"cuda_mps={cuda_mps!r}: use 'auto', 'on' or 'off'")
        self.cuda_mps = cuda_mps
        self.gateway = gateway
        if engine not in ("auto", "sglang", "reference"):
            raise ConfigError(f"engine={engine!r}: use 'auto', 'sglang' or 'reference'")
        check_compatible(config, trainer_config)
        self.trainer_config = trainer_config
        self.shared_strategy = shared_strategy
        if layout is not None and (device_config is not None or engine not in ("auto", layout.engine)):
            raise ConfigError(
                "layout= is a finished device layout: give it alone, without device_config, GPU arguments "
                "or another engine"
            )
        # What the first model's _internal_config may still change (server flags, GPUs if none were set).
        self._requested_config = config
        self._device_request = (device_config, engine)
        self._devices_given = layout is not None or (
            device_config is not None and bool(device_config.model_fields_set & set(GPU_FIELDS))
        )
        self.cluster = ClusterConfig(address=cluster) if isinstance(cluster, str) else cluster
        if self.cluster is not None:
            if self._devices_given or device_config is not None:
                raise ConfigError(
                    "cluster= places the inference replicas on the Ray cluster's nodes and trains on this "
                    "machine's GPUs: drop inference_device(s)/training_devices/device_config/layout"
                )
            self._devices_given = True  # a model's _internal_config may not name GPUs either
            layout = cluster_layout(self.cluster, engine, config.tensor_parallel_size)
        self._initial_layout = layout or choose_layout(
            device_config, engine=engine, tensor_parallel_size=config.tensor_parallel_size
        )
        config = serve_trained(config, trainer_config)
        self._configure(self._initial_layout, config)
        self._chosen_config = config  # the server's settings before shared mode's memory plan
        self.use_cuda_mps(log=False)  # cuda_mps='on' where it cannot apply fails here, before anything starts

    def settings_for(
        self,
        model: Any,
        store: ModelStore,
        *,
        registered: list[tuple[str, str]],
        served_base_model: str | None,
    ) -> ModelSettings:
        """The model's settings, once it is certain this backend can serve and train it (`registered`:
        the (project, name) of the models it has; `served_base_model`: None before the server runs)."""
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
        settings = model_settings(internal_config_of(model), self.trainer_config)
        if served_base_model is None:
            self.apply_first_model(settings, store)
        else:
            self.check_same_server(model, settings, served_base_model)
        check_compatible(self.sglang_config, settings.trainer)
        return settings

    def _configure(self, layout: DeviceLayout, config: SGLangConfig) -> None:
        """Set the device layout and the server config that follows from it (shared mode's memory saver)."""
        self.layout = layout
        self.handoff_strategy: HandoffStrategy = "none"
        if layout.mode == "shared" and self.shared_strategy != "co_resident":
            self.handoff_strategy = self.shared_strategy
        check_replicas(config, layout, gateway=self.gateway)
        config = fit_replicas(config, layout)
        if self.handoff_strategy == "sleep":
            check_memory_saver(config)
            config = with_memory_saver(config)
        self.sglang_config = config

    def apply_first_model(self, settings: ModelSettings, store: ModelStore) -> None:
        """The first model's `_internal_config` may choose the server's flags and the GPUs."""
        config = self._requested_config.model_copy(update=server_updates(settings, store))
        # Validated again with only the fields set, so settings the user left alone stay defaults.
        config = SGLangConfig.model_validate(config.model_dump(exclude_unset=True))
        layout = self._initial_layout
        if settings.inference_gpu_ids is not None and settings.trainer_gpu_ids is not None:
            layout = self._layout_for(settings.inference_gpu_ids, settings.trainer_gpu_ids, config)
        config = serve_trained(config, settings.trainer)
        self._configure(layout, config)
        self._chosen_config = config

    def _layout_for(self, inference: list[int], training: list[int], config: SGLangConfig) -> DeviceLayout:
        if self._devices_given:
            raise ConfigError(
                "_internal_config sets trainer_gpu_ids/inference_gpu_ids, and SGLangBackend was given its "
                "devices too: set the GPUs in one place"
            )
        if len(inference) != config.tensor_parallel_size:
            raise ConfigError(
                f"_internal_config inference_gpu_ids={inference} must list tensor_parallel_size="
                f"{config.tensor_parallel_size} GPU(s) (consecutive, from the first)"
            )
        device_config, engine = self._device_request
        where = "_internal_config trainer_gpu_ids/inference_gpu_ids"
        devices = device_request(
            device_config, where, inference_device=inference[0], training_devices=training
        )
        try:
            return choose_layout(devices, engine=engine, tensor_parallel_size=config.tensor_parallel_size)
        except ConfigError as exc:
            raise ConfigError(f"_internal_config trainer_gpu_ids/inference_gpu_ids: {exc}") from None

    def check_same_server(self, model: Any, settings: ModelSettings, served_base_model: str) -> None:
        """A later model shares the running server: it may not ask for different server settings."""
        if served_base_model != model.base_model:
            raise ConfigError(
                f"this backend serves base model {served_base_model!r}; model {model.name!r} uses "
                f"{model.base_model!r}: one server serves one base model, so use a second SGLangBackend"
            )
        if not SYNC_TRAITS[self.sglang_config.weight_sync_method].several_models:
            raise ConfigError(
                "weight_sync_method='disk' merges one model's weights into the server's base weights, so "
                "only one model can be registered: use weight_sync_method='lora' to serve several"
            )
        different: dict[str, Any] = {
            key: value
            for key, value in settings.server_updates.items()
            if getattr(self._chosen_config, key) != value
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

    @property
    def co_resident(self) -> bool:
        """One GPU for both, no handoff: the server serves while the trainer trains."""
        return self.layout.mode == "shared" and self.shared_strategy == "co_resident"

    def use_cuda_mps(self, *, log: bool = True) -> bool:
        """Whether the co-resident server and trainer share the GPU through CUDA MPS (`cuda_mps`: "on"
        where it cannot apply is a ConfigError; "auto" uses it where it can, and says so where not)."""
        if self.cuda_mps == "off":
            return False
        if not self.co_resident or self.layout.engine != "sglang":
            if self.cuda_mps == "on":
                raise ConfigError(
                    "cuda_mps='on' applies to shared_strategy='co_resident' on SGLang (server and trainer on "
                    "one GPU at once): use cuda_mps='auto' or 'off'"
                )
            return False
        if control_program() is not None:
            return True
        if self.cuda_mps == "on":
            raise ConfigError(f"cuda_mps='on' needs {CONTROL} (part of the NVIDIA driver) on PATH")
        if log:
            logger.info(
                "co-resident without CUDA MPS (%s is not on PATH): server and trainer take turns on the GPU",
                CONTROL,
            )
        return False

    def plan(self, base_model: str) -> ServingPlan:
        """The frozen plan for serving `base_model` (blocking: reads GPU and model sizes); call once the
        first model's settings were applied."""
        layout = self.layout
        config = self.sglang_config
        if self.cluster is not None:
            check_cluster_sync(config)
        release: Literal["kv_cache", "all"] = "all"
        if self.handoff_strategy == "sleep":
            shared = self._shared_plan(base_model)
            config = config.model_copy(update={"mem_fraction_static": shared.mem_fraction_static})
            release = shared.release
            logger.info(
                "shared mode: each step releases the server's %s%s (mem_fraction_static %.3f): %s",
                "KV cache; the trainer keeps its model on the GPU" if shared.trainer_resident else "weights",
                "" if shared.trainer_resident else " and KV cache; the trainer moves to host memory",
                shared.mem_fraction_static,
                shared.reason,
            )
        elif self.co_resident:  # no handoff: the server's pool leaves the trainer room
            total = _gpu_total_bytes(layout)
            if total is None and layout.engine == "sglang":
                raise ConfigError(
                    "shared_strategy='co_resident' needs the GPU's memory size (nvidia-smi did not report it) to "
                    "leave room for the trainer: use shared_strategy='sleep'"
                )
            fraction = plan_co_resident(
                gpu_total_bytes=total,
                weights_bytes=model_weights_bytes(base_model),
                mem_fraction_static=config.mem_fraction_static,
                fraction_set_by_user="mem_fraction_static" in config.model_fields_set,
            )
            config = config.model_copy(update={"mem_fraction_static": fraction})
            logger.info(
                "shared mode, co-resident: server and trainer stay on the GPU (mem_fraction_static %.3f)",
                fraction,
            )
        frozen = frozen_config(config)
        return ServingPlan(
            layout=layout,
            server_config=frozen,
            replicas=_replicas(layout, frozen),
            training_gpu_ids=tuple(_gpu_ids(layout, layout.training_gpus)),
            handoff=self.handoff_strategy,
            release=release,
            cuda_mps=self.co_resident and self.use_cuda_mps(),
            weight_sync=config.weight_sync_method,
            cluster=self.cluster,
        )

    def _shared_plan(self, base_model: str) -> SharedPlan:
        """What a sleep handoff releases, from the shared GPU's size and the base model's."""
        config = self.sglang_config
        requested = config.sleep_release
        total = _gpu_total_bytes(self.layout)
        if total is None and self.layout.engine == "sglang" and requested == "auto":
            return SharedPlan("all", config.mem_fraction_static, "the GPU's memory size is unknown")
        return plan_shared_gpu(
            requested,
            gpu_total_bytes=total,
            weights_bytes=model_weights_bytes(base_model),
            mem_fraction_static=config.mem_fraction_static,
            fraction_set_by_user="mem_fraction_static" in config.model_fields_set,
        )


def server_updates(settings: ModelSettings, store: ModelStore) -> dict[str, Any]:
    """SGLangConfig fields from a model's settings; a template given as text goes to a file the server
    reads (SGLang's --chat-template takes a path)."""
    updates = dict(settings.server_updates)
    if settings.chat_template_path is not None:
        updates["chat_template"] = settings.chat_template_path
    elif settings.chat_template is not None:
        updates["chat_template"] = str(store.chat_template_file)
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
    decode step and changes nothing."""
    if config.lora_target_modules is not None:
        return config
    return config.model_copy(update={"lora_target_modules": list(trainer.target_modules)})


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


def _gpu_total_bytes(layout: DeviceLayout) -> int | None:
    """The shared GPU's memory; None on the reference engine or when nvidia-smi does not list it."""
    if layout.engine != "sglang" or not layout.inference_gpus:
        return None
    gpus = {gpu.index: gpu for gpu in detect_gpus().gpus}
    gpu = gpus.get(layout.inference_gpus[0])
    return gpu.memory_total_mib * 2**20 if gpu is not None else None
