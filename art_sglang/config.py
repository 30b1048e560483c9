"""Configuration models. Every server flag the backend relies on is an `SGLangConfig` field marked
`LaunchFlag`: its name, help text and validation live in that one field, and `SGLangConfig.server_args`
renders the command line from the marked fields. Where the GPUs are asked for is `DeviceConfig` (this
machine) or `ClusterConfig` (replicas on the nodes of a Ray cluster)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from .server_defaults import (
    SERVER_PYTHON_ENV,
    SERVER_TIMEOUT_ENV,
    SERVER_VENV_DIR,
    default_server_timeout,
    find_server_python,
)
from .tool_choice import DEFAULT_PARSER

WeightSyncMethod = Literal["lora", "disk", "restart", "merged"]
# The launch flags of LoRA serving, left out where no adapter is ever loaded (weight_sync_method="merged").
LORA_FLAGS = frozenset({"max_loras_per_batch", "max_lora_rank", "lora_target_modules", "lora_backend"})
SharedStrategy = Literal["sleep", "restart", "co_resident"]
CudaMpsMode = Literal["auto", "on", "off"]
SleepRelease = Literal["auto", "kv_cache", "all"]
RouterPolicy = Literal["cache_aware", "round_robin", "power_of_two", "random"]


# A training step counts as hung once the trainer sends nothing (no progress event, no result) for
# HANG_FACTOR times its longest step so far, at least HANG_FLOOR_S (TrainerConfig.step_timeout: the ceiling).
HANG_FACTOR = 10.0
HANG_FLOOR_S = 10.0

# The linear layers SGLang can serve LoRA on for Llama/Qwen-style models.
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_LORA_RANK = 8


@dataclass(frozen=True)
class LaunchFlag:
    """Marks an `SGLangConfig` field as an SGLang launch flag (`Annotated[T, LaunchFlag()]`), spelled
    `--field-name` unless `spelling` says otherwise."""

    spelling: str | None = None


class SGLangConfig(BaseModel):
    """How the inference server is launched and how new weights reach it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    # --- names from the product description -------------------------------------------------------
    mem_fraction_static: Annotated[float, LaunchFlag()] = Field(
        0.9, gt=0.0, lt=1.0, description="Fraction of the inference GPU's memory for weights and KV cache."
    )
    disable_radix_cache: Annotated[bool, LaunchFlag()] = Field(
        False, description="Turn off RadixAttention prefix caching (not advised)."
    )
    max_loras_per_batch: Annotated[int, LaunchFlag()] = Field(
        4, ge=1, description="Adapters servable in one batch (LoRA pool slots)."
    )
    context_length: Annotated[int | None, LaunchFlag()] = Field(
        None, ge=16, description="Maximum context; None = the model's own."
    )
    weight_sync_method: WeightSyncMethod = Field(
        "lora",
        description="How a new step reaches the server: 'lora' loads the adapter, 'disk' merges it and calls "
        "update_weights_from_disk, 'restart' restarts the server with it, 'merged' (opt-in, docs/guide.md) "
        "serves the trainer's merged weights without LoRA, pushed from memory (CUDA IPC or NCCL).",
    )
    merged_bucket_bytes: int = Field(
        512 << 20,
        ge=1,
        description="weight_sync_method='merged': the most bytes of merged weights pushed in one request.",
    )
    flush_cache_on_sync: bool | None = Field(
        None, description="Flush the prefix cache after each sync; None: 'merged' only."
    )
    server_timeout: float = Field(
        default_factory=default_server_timeout,
        gt=0,
        validation_alias=AliasChoices("server_timeout", "startup_timeout"),
        description=f"Seconds to wait for the server to become healthy (env {SERVER_TIMEOUT_ENV}).",
    )
    # --tp-size: SGLang's short name, as launch scripts write it.
    tensor_parallel_size: Annotated[int, LaunchFlag("--tp-size")] = Field(
        1, ge=1, description="Tensor-parallel size of the server."
    )
    unresponsive_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds a running server may fail to answer GET /health, or take over an adapter load "
        "or unload, before it is restarted (a hung or stopped process, not only a dead one).",
    )

    # --- launch flags the backend relies on ----------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the server binds to.")
    port: int | None = Field(None, ge=1, le=65535, description="Server port; None picks a free one.")
    max_lora_rank: Annotated[int | None, LaunchFlag()] = Field(
        None,
        ge=1,
        description="Largest adapter rank the server's LoRA pool holds. None = the trainer's lora_rank: a pool "
        "no wider than the adapters, so less memory and cheaper LoRA kernels.",
    )
    lora_target_modules: Annotated[list[str] | None, LaunchFlag()] = Field(
        None,
        min_length=1,
        description="Modules adapters may target ('all': every linear layer, lm_head and embed_tokens too). "
        "None = the trainer's target_modules: LoRA kernels run only where the trained adapters have "
        "weights (faster decoding than 'all', docs/benchmarks.md).",
    )
    lora_backend: Annotated[str | None, LaunchFlag()] = Field(
        "triton",
        description="SGLang --lora-backend, the kernels that apply adapters: 'triton' (with the experimental path "
        "the fastest decode in 0.5.17, docs/benchmarks.md), 'csgmv' (also None: SGLang's own default).",
    )
    lora_experimental_path: bool | None = Field(
        None,
        description="SGLang 0.5.17's experimental triton LoRA path (its SGLANG_EXPERIMENTAL_LORA_OPTI): each LoRA "
        "shrink on a second CUDA stream beside the base GEMM. It computes NaN for an adapter whose rank is not "
        "max_lora_rank. None: a backend settles it, on where it can run (lora_backend='triton' and a pool of the "
        "trainer's lora_rank: max_lora_rank unset or equal), off elsewhere; True: required (refused otherwise).",
    )
    attention_backend: Annotated[str | None, LaunchFlag()] = Field(
        None, description="SGLang --attention-backend; None = its default."
    )
    sampling_backend: Annotated[str | None, LaunchFlag()] = Field(
        None, description="SGLang --sampling-backend; None = its default."
    )
    enable_cache_report: Annotated[bool, LaunchFlag()] = Field(
        True, description="Report cached prompt tokens in usage."
    )
    enable_metrics: Annotated[bool, LaunchFlag()] = Field(
        False, description="Expose Prometheus metrics on /metrics."
    )
    enable_memory_saver: Annotated[bool, LaunchFlag()] = Field(
        False, description="Let the server release/resume GPU memory (shared mode 'sleep' turns it on)."
    )
    sleep_release: SleepRelease = Field(
        "auto",
        description="What shared mode's 'sleep' frees for a training step: 'kv_cache' (the server keeps its "
        "weights, the trainer keeps its model on the GPU), 'all' (weights too, copied to host memory; the "
        "trainer moves to host memory between steps), or 'auto' (kv_cache when both copies of the weights "
        "fit, shrinking mem_fraction_static unless it was set).",
    )
    enable_weights_cpu_backup: Annotated[bool, LaunchFlag()] = Field(
        False,
        description="Keep a CPU copy of weights so releasing memory frees them too (with memory saver).",
    )
    disable_cuda_graph: Annotated[bool, LaunchFlag()] = Field(
        False, description="Skip CUDA-graph capture: faster start, slower decode."
    )
    disable_prefill_cuda_graph: Annotated[bool, LaunchFlag()] = Field(
        False,
        description="Skip only the prefill CUDA graphs SGLang captures by default (decode keeps its "
        "graphs): a shorter server start, slower prefill of small batches.",
    )
    api_key: str | None = Field(
        None,
        description="Key rollout clients must send (model.openai_client() sends it); None = any. The server's "
        "admin routes get a key of their own, and behind the gateway its other routes too "
        "(clients never hold those); keys reach the server in a private file, never on its command line.",
    )
    tool_call_parser: Annotated[str | None, LaunchFlag()] = Field(
        DEFAULT_PARSER,
        description="SGLang --tool-call-parser: how `<tool_call>` markup in a completion becomes "
        "`message.tool_calls` on requests with `tools` ('hermes', as ART's vLLM server; 'qwen25' for "
        "Qwen2.5's own format; None = tool calls stay in the text).",
    )
    chat_template: Annotated[str | None, LaunchFlag()] = Field(
        None, description="SGLang --chat-template: a template file (or builtin name); None = the model's."
    )
    server_python: str | None = Field(
        None,
        description=f"Python of the isolated server venv; None finds {SERVER_VENV_DIR}/bin/python "
        f"or ${SERVER_PYTHON_ENV}.",
    )
    server_env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the server.")
    extra_args: list[str] = Field(
        default_factory=list, description="Further CLI flags passed through verbatim."
    )

    share_prefill: bool = Field(
        True,
        description="Requests of one prompt that arrive together (ART's GRPO groups) wait until one "
        "prefill-only request computed the prompt, then go as they came: SGLang alone computes a prompt "
        "once per request that reaches it together with others. False = every request is forwarded at once.",
    )
    share_prefill_lead_ms: float = Field(
        3.0,
        ge=0,
        le=100,
        description="With share_prefill: how long the first request of a prompt waits for another with the "
        "same prompt (a request that shares nothing is delayed this much and a few event-loop turns at most). "
        "0: the first never waits, and a group's prompt is computed twice (by it and the prefill-only request).",
    )

    router_policy: RouterPolicy = Field(
        "cache_aware",
        description="How SGLang's router spreads requests over server replicas (inference_devices) for clients "
        "that reach it without the gateway (gateway=False): 'cache_aware' sends a prompt to the replica holding "
        "its longest cached prefix unless the load is uneven. Through the gateway, the gateway picks the "
        "replica (a GRPO group together, a conversation on its replica) and the router checks their health.",
    )

    # --- weight sync ---------------------------------------------------------------------------------
    adapters_to_keep: int = Field(
        2,
        ge=1,
        description="Adapters kept loaded (newest first) so requests in flight on older steps finish.",
    )
    max_steps_off_policy: int | None = Field(
        None,
        ge=0,
        description="ART's PipelineTrainer max_steps_off_policy (None: not pipelined): rollouts use adapters"
        " of up to that + 1 steps at once (max_loras_per_batch is raised to that unless set); with 'merged', "
        "train() refuses a rollout sampled by weights more steps behind the trained one (None: 0).",
    )

    @model_validator(mode="before")
    @classmethod
    def _pool_for_pipelining(cls, data: Any) -> Any:
        pipelined = isinstance(data, dict) and data.get("max_steps_off_policy") is not None
        if pipelined and "max_loras_per_batch" not in data:
            # One pool slot per step a rollout may still be on, so no step waits for a slot.
            default = cls.model_fields["max_loras_per_batch"].default
            return {**data, "max_loras_per_batch": max(default, data["max_steps_off_policy"] + 1)}
        return data

    @field_validator("lora_target_modules")
    @classmethod
    def _no_blank_targets(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not m.strip() for m in value):
            raise ValueError("lora_target_modules must not contain empty names")
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_keys_in_extra_args(cls, value: list[str]) -> list[str]:
        taken = sorted({arg.split("=")[0] for arg in value} & {"--api-key", "--admin-api-key", "--config"})
        if taken:
            raise ValueError(
                f"extra_args must not give {', '.join(taken)}: the backend passes the server keys of its own "
                "in a private --config file (a key on a command line is readable by every local user); "
                "set SGLangConfig.api_key for the key rollout clients send"
            )
        return value

    @model_validator(mode="after")
    def _weights_backup_needs_saver(self) -> SGLangConfig:
        if self.enable_weights_cpu_backup and not self.enable_memory_saver:
            raise ValueError("enable_weights_cpu_backup=True needs enable_memory_saver=True")
        if self.max_steps_off_policy is not None and self.max_loras_per_batch <= self.max_steps_off_policy:
            raise ValueError(
                f"max_steps_off_policy={self.max_steps_off_policy} has rollouts on "
                f"{self.max_steps_off_policy + 1} steps' adapters at once: raise max_loras_per_batch to "
                f"{self.max_steps_off_policy + 1} or leave it unset"
            )
        if self.max_loras_per_batch < 2 and self.weight_sync_method == "lora" and self.adapters_to_keep > 1:
            # Keeping an older adapter loaded next to the new one needs two pool slots.
            raise ValueError(
                "max_loras_per_batch must be >= 2 to keep older adapters loaded; "
                "raise it or set adapters_to_keep=1"
            )
        return self

    @property
    def experimental_lora_served(self) -> bool:
        """The experimental LoRA path runs: asked for (a backend's plan settles None) where adapters are served."""
        return bool(self.lora_experimental_path) and self.weight_sync_method != "merged"

    def resolved_server_python(self) -> str:
        """The interpreter that launches SGLang: the configured one, the isolated venv, or this Python."""
        return self.server_python or find_server_python() or sys.executable

    def server_args(self, model_path: str, port: int) -> list[str]:
        """Arguments after `python -m sglang.launch_server` (the reference engine takes the same): the
        `LaunchFlag` fields in field order. A switch is given when True, a None value leaves its flag out
        (the server's own default), a list gives its items. With merged weights LoRA is off (`LORA_FLAGS`)."""
        lora = self.weight_sync_method != "merged"  # merged weights: no LoRA kernels at all
        args = ["--model-path", model_path, "--host", self.host, "--port", str(port)]
        args += ["--enable-lora"] if lora else []
        # Unset outside a backend (whose plan puts the trainer's here): the default trainer's.
        trained = {"lora_target_modules": DEFAULT_LORA_TARGETS, "max_lora_rank": DEFAULT_LORA_RANK}
        for field, flag in LAUNCH_FLAGS.items():
            value = trained.get(field) if getattr(self, field) is None else getattr(self, field)
            if field in LORA_FLAGS and not lora:
                continue
            if isinstance(value, bool):
                args.extend([flag] if value else [])
            elif isinstance(value, list):
                args.extend([flag, *value])
            elif value is not None:
                args.extend([flag, str(value)])
        return [*args, *self.extra_args]


# field -> flag of every SGLangConfig field marked `LaunchFlag`, in field order (the reference engine's
# command line takes its help for these flags from the field descriptions).
LAUNCH_FLAGS: dict[str, str] = {
    name: marker.spelling or "--" + name.replace("_", "-")
    for name, field in SGLangConfig.model_fields.items()
    for marker in field.metadata
    if isinstance(marker, LaunchFlag)
}


class DeviceConfig(BaseModel):
    """Which GPUs serve inference and which train. With auto_detect, unset fields follow the GPUs found."""

    model_config = ConfigDict(extra="forbid")

    inference_device: int = Field(0, ge=0, description="GPU index of the SGLang server.")
    inference_devices: list[int] | None = Field(
        None,
        description="First GPU of each SGLang server replica (the gateway spreads requests over them; a GPU "
        "listed twice holds two replicas); None = one server on inference_device.",
    )
    training_devices: list[int] = Field(default_factory=lambda: [1], description="GPU indices for training.")
    auto_detect: bool = Field(True, description="Detect GPUs and choose the mode from their number.")

    @field_validator("inference_devices")
    @classmethod
    def _gpu_indices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(d < 0 for d in value):
            raise ValueError(f"inference_devices must be GPU indices >= 0, got {value}")
        return value

    @field_validator("training_devices")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if any(d < 0 for d in value):
            raise ValueError(f"training_devices must be GPU indices >= 0, got {value}")
        repeated = sorted({d for d in value if value.count(d) > 1})
        if repeated:
            # One trainer rank per listed GPU: two ranks cannot share one GPU.
            raise ValueError(
                f"training_devices={value} lists GPU {','.join(map(str, repeated))} more than once: list each "
                "training GPU once (the trainer runs one data-parallel rank per GPU)"
            )
        return value


class ClusterConfig(BaseModel):
    """Inference replicas as Ray actors on the nodes of a running Ray cluster (`ray start`). The backend,
    the gateway, SGLang's router, the trainer and the checkpoints stay on this machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(
        "auto", description="The Ray cluster to join (ray.init's address): 'auto' finds the local node's."
    )
    inference_replicas: int = Field(1, ge=1, description="Server replicas, each a Ray actor on some node.")
    gpus_per_replica: float = Field(
        1,
        ge=0,
        description="GPUs each replica holds (at least tensor_parallel_size; 0 for CPU test engines).",
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each replica needs besides its GPUs (to keep replicas on chosen nodes).",
    )
    adapter_dir: str | None = Field(
        None,
        description="Node-local folder the replicas write adapters into (a subfolder each); None = the node's "
        "temporary folder.",
    )
    shared_filesystem: bool = Field(
        False,
        description="Every node reads the checkpoint folder at the same path: adapters are loaded from it "
        "directly instead of being shipped.",
    )
    placement_timeout: float = Field(
        300.0, gt=0, description="Seconds a replica may wait for a node with room before its start fails."
    )


class TrainerConfig(BaseModel):
    """The trainer worker: LoRA shape, precision and memory knobs."""

    model_config = ConfigDict(extra="forbid")

    lora_rank: int = Field(
        DEFAULT_LORA_RANK, ge=1, description="LoRA rank (at most SGLangConfig.max_lora_rank, if set)."
    )
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1, description="Modules to adapt."
    )
    use_unsloth: bool | Literal["auto"] = Field(
        "auto", description="Unsloth FastLanguageModel when it imports and CUDA is present ('auto')."
    )
    gradient_checkpointing: bool | None = Field(None, description="None = on with a GPU, off on CPU.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="'auto' = bfloat16 on GPU, float32 on CPU."
    )
    max_seq_length: int = Field(
        32768,
        ge=16,
        description="Longest packed row (ART's default); longer sequences are dropped with a warning, "
        "counted in the step's `sequences_dropped_too_long`.",
    )
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one forward/backward pass.")
    max_grad_norm: float | None = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="Gradient clipping per optimizer step (ART: 0.1); None = off.",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (ART: 0.9).")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2 (ART: 0.99).")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(
        0.1, ge=0, allow_inf_nan=False, description="AdamW decoupled weight decay of RL steps (ART: 0.1)."
    )
    load_in_4bit: bool = Field(
        False, description="Load the base model 4-bit quantized for training (Unsloth on a GPU only)."
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template text used to tokenize training data; None = the model's."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra chat-template variables for training tokenization (as requests send them).",
    )
    seed: int = Field(0, description="Seed for LoRA init and any sampling in the trainer.")
    trainer_python: str | None = Field(None, description="Python that runs the trainer; None = this one.")
    step_timeout: float = Field(
        3600.0,
        gt=0,
        description="Seconds one training step (or offload/reload) may take; longer is an error and the "
        "trainer is restarted at the next step. A step is also an error once the trainer has sent nothing "
        f"for {HANG_FACTOR:g} times its longest step so far (at least {HANG_FLOOR_S:g} s).",
    )
