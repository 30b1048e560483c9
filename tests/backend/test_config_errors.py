"""Configurations and train() options that cannot work fail at once, before any process starts, with a
message naming the fix."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import psutil
import pytest
from pydantic import ValidationError

import art_sglang as art
from art_sglang import ConfigError, DeviceConfig, SGLangBackend, SGLangConfig, TrainerConfig
from art_sglang.config import DEFAULT_LORA_TARGETS
from art_sglang.planning.config_checks import check_cluster_sync, check_compatible, check_same_server
from art_sglang.planning.devices import DeviceLayout, detect_gpus
from art_sglang.planning.internal_config import model_settings
from art_sglang.planning.make_plan import make_plan
from art_sglang.planning.request import BackendRequest
from art_sglang.planning.serving_plan import ServingPlan
from art_sglang.serving.adapters import InferenceService
from art_sglang.storage.model_store import ModelStore
from art_sglang.training.options import TrainOptions

CPU_SHARED = DeviceLayout("shared", "reference", (), (), "forced for tests")


def _children() -> int:
    return len(psutil.Process().children(recursive=True))


def test_lora_rank_above_server_max_names_both_settings():
    before = _children()
    with pytest.raises(ConfigError, match=r"lora_rank=32.*max_lora_rank=16.*raise max_lora_rank"):
        SGLangBackend(
            engine="reference",
            sglang_config=SGLangConfig(max_lora_rank=16),
            trainer_config=TrainerConfig(lora_rank=32),
        )
    assert _children() == before


def test_trained_modules_must_be_served():
    with pytest.raises(ConfigError, match=r"\['down_proj'.*lora_target_modules=\['all'\]"):
        SGLangBackend(
            engine="reference",
            sglang_config=SGLangConfig(lora_target_modules=["qkv_proj", "o_proj"]),
            trainer_config=TrainerConfig(target_modules=["q_proj", "v_proj", "down_proj", "up_proj"]),
        )


def test_fused_server_targets_cover_their_parts():
    backend = SGLangBackend(
        engine="reference",
        sglang_config=SGLangConfig(lora_target_modules=["qkv_proj"]),
        trainer_config=TrainerConfig(target_modules=["q_proj", "k_proj", "v_proj"]),
    )
    assert backend.layout.mode == "cpu"


def test_the_server_adapts_the_trained_modules_unless_told(tmp_path):
    assert SGLangBackend(engine="reference").sglang_config.lora_target_modules == DEFAULT_LORA_TARGETS
    trainer = TrainerConfig(target_modules=["q_proj", "v_proj"])
    backend = SGLangBackend(engine="reference", trainer_config=trainer)
    assert backend.sglang_config.lora_target_modules == ["q_proj", "v_proj"]
    assert "--lora-target-modules q_proj v_proj" in " ".join(backend.sglang_config.server_args("m", 1))
    told = SGLangConfig(lora_target_modules=["all"])
    backend = SGLangBackend(engine="reference", sglang_config=told, trainer_config=trainer)
    assert backend.sglang_config.lora_target_modules == ["all"]
    # The first model's own LoRA (ART's peft_args) decides what the server adapts.
    request = BackendRequest(SGLangConfig(), TrainerConfig(), layout=CPU_SHARED, shared_strategy="restart")
    first = model_settings({"peft_args": {"target_modules": ["o_proj"]}}, request.trainer)
    template = str(ModelStore(tmp_path, "p", "m").chat_template_file)
    plan = make_plan(request, first, detect_gpus(), template_file=template)
    assert plan.server_config.lora_target_modules == ["o_proj"]
    # A second model training other modules than those served is refused, naming them.
    with pytest.raises(ConfigError, match=r"trains \['q_proj'\].*lora_target_modules=\['o_proj'\]"):
        check_compatible(plan.server_config, TrainerConfig(target_modules=["q_proj"]))
    # Outside a backend, the default trainer's modules.
    assert f"--lora-target-modules {' '.join(DEFAULT_LORA_TARGETS)}" in " ".join(
        SGLangConfig().server_args("m", 1)
    )


def test_the_lora_pool_holds_the_trained_rank_unless_told(tmp_path):
    """Unset, max_lora_rank is the trainer's lora_rank (the first model's, ART's peft_args r); a second model
    of a higher rank is refused, naming the setting; a given max_lora_rank stays (a pool for several ranks:
    without the experimental LoRA path, which serves the pool's rank only)."""
    assert SGLangBackend(engine="reference").sglang_config.max_lora_rank == 8
    trainer = TrainerConfig(lora_rank=16)
    backend = SGLangBackend(engine="reference", trainer_config=trainer)
    assert "--max-lora-rank 16" in " ".join(backend.sglang_config.server_args("m", 1))
    told = SGLangConfig(max_lora_rank=64, lora_experimental_path=False)
    backend = SGLangBackend(engine="reference", sglang_config=told, trainer_config=trainer)
    assert backend.sglang_config.max_lora_rank == 64
    several = SGLangConfig(lora_experimental_path=False)
    request = BackendRequest(several, TrainerConfig(), layout=CPU_SHARED, shared_strategy="restart")
    first = model_settings({"peft_args": {"r": 32}}, request.trainer)
    template = str(ModelStore(tmp_path, "p", "m").chat_template_file)
    plan = make_plan(request, first, detect_gpus(), template_file=template)
    assert plan.server_config.max_lora_rank == plan.requested_config.max_lora_rank == 32
    with pytest.raises(
        ConfigError, match=r"lora_rank=64\) exceeds.*max_lora_rank=32.*first model's lora_rank"
    ):
        check_compatible(plan.server_config, TrainerConfig(lora_rank=64))
    check_compatible(plan.server_config, TrainerConfig(lora_rank=16))


def test_bad_strategy_and_engine_names():
    with pytest.raises(ConfigError, match="'sleep', 'restart' or 'co_resident'"):
        SGLangBackend(shared_strategy="nap")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'auto', 'sglang' or 'reference'"):
        SGLangBackend(engine="vllm")  # type: ignore[arg-type]


def test_gpus_with_the_cpu_engine_are_refused():
    with pytest.raises(ConfigError, match="engine='reference' runs on CPU"):
        SGLangBackend(engine="reference", inference_device=0, training_devices=[1])


def test_gpus_given_in_two_forms_are_refused():
    # The GPU arguments are sugar for a DeviceConfig: naming GPUs in both is a clash, not a merge.
    with pytest.raises(ConfigError, match=r"GPUs are set twice: .*training_devices.*inference_device"):
        SGLangBackend(device_config=DeviceConfig(inference_device=0), training_devices=[1])
    for others in ({"device_config": DeviceConfig()}, {"training_devices": [0]}, {"engine": "sglang"}):
        with pytest.raises(ConfigError, match="layout= is a finished device layout: give it alone"):
            SGLangBackend(layout=CPU_SHARED, **others)  # type: ignore[arg-type]
    assert SGLangBackend(layout=CPU_SHARED, engine="reference").layout == CPU_SHARED


async def test_gpus_in_internal_config_and_device_config_are_refused(tmp_path, tiny_model_path):
    devices = DeviceConfig(inference_device=0, training_devices=[0], auto_detect=False)
    async with SGLangBackend(path=str(tmp_path), device_config=devices) as backend:
        model = art.TrainableModel(
            name="m",
            project="p",
            base_model=str(tiny_model_path),
            _internal_config={"trainer_gpu_ids": [0], "inference_gpu_ids": [0]},
        )
        with pytest.raises(ConfigError, match="SGLangBackend was given its devices too"):
            await model.register(backend)
        assert backend.inference is None


def test_sleep_turns_on_the_memory_saver_and_refuses_it_switched_off():
    backend = SGLangBackend(layout=CPU_SHARED, shared_strategy="sleep")
    assert backend.sglang_config.enable_memory_saver and backend.sglang_config.enable_weights_cpu_backup
    assert backend.handoff_strategy == "sleep"
    restart = SGLangBackend(layout=CPU_SHARED, shared_strategy="restart")
    assert not restart.sglang_config.enable_memory_saver and restart.handoff_strategy == "restart"
    with pytest.raises(ConfigError, match=r"needs SGLangConfig\(enable_memory_saver=True\).*'restart'"):
        SGLangBackend(
            layout=CPU_SHARED, shared_strategy="sleep", sglang_config=SGLangConfig(enable_memory_saver=False)
        )


def test_art_defaults_and_keywords_are_accepted_and_mapped():
    options = TrainOptions.from_keywords({})
    assert (options.loss_fn, options.learning_rate, options.clip) == ("cispo", 5e-6, (1.0, 4.0))
    assert TrainOptions.from_keywords({"loss_fn": "ppo"}).clip == (0.2, 0.2)
    assert TrainOptions.from_keywords({"loss_fn": "ppo", "epsilon": 0.1}).clip == (0.1, 0.1)
    assert TrainOptions.from_keywords({"epsilon": 0.5}).clip == (0.5, 4.0)  # ART: epsilon_high stays 4.0
    assert TrainOptions.from_keywords({"normalize_advantages": False}).scales_rewards is False
    # ART keywords at their default pass, with or without an effect here.
    TrainOptions.from_keywords(
        {"plot_tensors": False, "loss_fn_config": None, "logprob_calculation_chunk_size": 512}
    )
    # The older model.train(..., _config=dev.TrainConfig) form.
    assert TrainOptions.from_dev_config({"ppo": True, "epsilon": 0.3}) == {"loss_fn": "ppo", "epsilon": 0.3}


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"plot_tensors": True}, r"plot_tensors=True is not supported.*only ART's default False"),
        ({"adam_params": {"lr": 1}}, r"adam_params=.*TrainerConfig\(adam_beta1"),
        ({"scale_learning_rate_by_reward_std_dev": True}, r"LocalBackend ignores it too"),
        ({"learning_rte": 1e-5}, r"unknown option\(s\) \['learning_rte'\].*takes learning_rate, loss_fn"),
        ({"loss_fn": "grpo"}, r"loss_fn='grpo': Input should be 'cispo' or 'ppo'"),
        ({"learning_rate": -1.0}, r"invalid train\(\) option: learning_rate=-1.0"),
        ({"learning_rate": float("inf")}, r"learning_rate=inf: Input should be a finite number"),
        ({"epsilon": float("nan")}, r"epsilon=nan"),
        ({"advantage_balance": 1.5}, r"advantage_balance=1.5"),
        ({"kl_penalty_reference_step": 1, "kl_ref_adapter_path": "/x"}, r"not both"),
    ],
)
def test_unsupported_unknown_or_bad_options_are_errors(keywords, match):
    with pytest.raises(ConfigError, match=match):
        TrainOptions.from_keywords(keywords)


def test_train_signature_lists_every_option():
    import inspect

    parameters = inspect.signature(SGLangBackend.train).parameters
    assert list(parameters)[:3] == ["self", "model", "trajectory_groups"]
    assert {name: p.default for name, p in parameters.items() if p.kind == p.KEYWORD_ONLY} == {
        name: info.default for name, info in TrainOptions.model_fields.items()
    }


def test_adapter_directories_are_checked_locally_before_loading(tmp_path):
    from art_sglang.errors import AdapterLoadError
    from art_sglang.storage.model_store import check_adapter

    pool = SGLangConfig(max_lora_rank=64)
    missing = tmp_path / "missing"
    with pytest.raises(AdapterLoadError, match=f"{missing} is not a directory"):
        check_adapter(missing, pool)
    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(AdapterLoadError, match=r"has no adapter_config\.json"):
        check_adapter(folder, pool)
    (folder / "adapter_config.json").write_text('{"r": 128}')
    with pytest.raises(AdapterLoadError, match=r"has no adapter_model\.safetensors or adapter_model\.bin"):
        check_adapter(folder, pool)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(
        AdapterLoadError, match=r"rank 128, above the server's max_lora_rank=64.*at least 128"
    ):
        check_adapter(folder, pool)
    check_adapter(folder, SGLangConfig(max_lora_rank=128))


def test_gpu_uuids_reach_the_children_unchanged(tmp_path):
    # CUDA_VISIBLE_DEVICES may name GPUs by UUID; the server and trainer must get the same names.
    from art_sglang.serving.servers.process import ServerProcess
    from art_sglang.training.process import TrainerProcess

    split = DeviceLayout("split", "sglang", (0,), (1,), "test", cuda_ids=("GPU-aa11", "GPU-bb22"))
    plan = _plan(split)
    inference, training = list(plan.replicas[0].gpu_ids), list(plan.training_gpu_ids)
    assert (inference, training) == (["GPU-aa11"], ["GPU-bb22"])
    server = ServerProcess(
        SGLangConfig(), "m", engine="sglang", log_path=tmp_path / "s.log", gpu_ids=inference
    )
    trainer = TrainerProcess(
        "m", tmp_path / "ckpt", TrainerConfig(), gpu_ids=training, log_path=tmp_path / "t.log"
    )
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-aa11"
    assert trainer.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-bb22"


def _plan(layout: DeviceLayout) -> ServingPlan:
    return make_plan(BackendRequest(SGLangConfig(), TrainerConfig(), layout=layout), None, detect_gpus())


def test_a_later_model_is_held_to_what_the_first_asked_for_not_to_the_fitted_settings():
    two_on_one = DeviceLayout("split", "sglang", (0,), (1,), "test", replica_gpus=((0,), (0,)))
    request = BackendRequest(SGLangConfig(), TrainerConfig(), layout=two_on_one)
    plan = make_plan(request, model_settings(None, request.trainer), detect_gpus())
    asked = SGLangConfig().mem_fraction_static
    assert plan.server_config.mem_fraction_static == 0.42 != asked  # fitted: two replicas share the GPU
    later = SimpleNamespace(name="later", project="p", base_model="m")
    same = model_settings({"engine_args": {"gpu_memory_utilization": asked}}, request.trainer)
    check_same_server(later, same, plan, "m")  # the setting the first model's server was asked for
    other = model_settings({"engine_args": {"gpu_memory_utilization": 0.3}}, request.trainer)
    with pytest.raises(ConfigError, match=r"asks for server settings \{'mem_fraction_static': 0.3\}"):
        check_same_server(later, other, plan, "m")
    with pytest.raises(ConfigError, match="one server serves one base model"):
        check_same_server(later, same, plan, "another-base-model")


def test_merged_weights_refuse_a_4bit_base_and_a_second_model():
    """The trainer's merged weights are the server's base plus the adapter: not from a 4-bit base, and of
    one model only."""
    merged = SGLangConfig(weight_sync_method="merged")
    with pytest.raises(ConfigError, match=r"4-bit trainer base.*load_in_4bit=False"):
        check_compatible(merged, TrainerConfig(load_in_4bit=True))
    request = BackendRequest(merged, TrainerConfig(), layout=CPU_SHARED)
    plan = make_plan(request, model_settings(None, request.trainer), detect_gpus())
    assert "--enable-lora" not in plan.server_config.server_args("m", 30001)
    later = SimpleNamespace(name="later", project="p", base_model="m")
    with pytest.raises(ConfigError, match=r"weight_sync_method='merged'.*only one model"):
        check_same_server(later, model_settings(None, request.trainer), plan, "m")
    # On SGLang the push is CUDA IPC to one server sharing the trainer's one GPU, else NCCL.
    pushes = {
        DeviceLayout("shared", "sglang", (0,), (0,), "test"): None,
        DeviceLayout("split", "sglang", (0,), (1,), "test"): "nccl",
        DeviceLayout("split", "sglang", (0, 1), (2, 3), "test", replica_gpus=((0,), (1,))): "nccl",
        DeviceLayout("split", "sglang", (0,), (), "test: trainer on CPU"): "gloo",
        DeviceLayout("cpu", "reference", (), (), "test", replica_gpus=((), ())): "gloo",
        CPU_SHARED: None,
    }
    for layout, group in pushes.items():
        plan = make_plan(BackendRequest(merged, TrainerConfig(), layout=layout), None, detect_gpus())
        assert (plan.weight_sync, plan.weight_update_group) == ("merged", group), layout
        # A trainer that broadcasts to SGLang runs NCCL as SGLang does (cuMem off), from its start.
        assert plan.trainer_env == ({"NCCL_CUMEM_ENABLE": "0"} if group == "nccl" else {}), layout
    for layout in (
        DeviceLayout("shared", "sglang", (0, 1), (0, 1), "test"),
        DeviceLayout("shared", "sglang", (0, 1), (0, 1), "test", replica_gpus=((0,), (1,))),
    ):
        with pytest.raises(ConfigError, match=r"shared mode on several GPUs.*use split mode"):
            make_plan(BackendRequest(merged, TrainerConfig(), layout=layout), None, detect_gpus())
    two_on_one = DeviceLayout("split", "sglang", (0,), (1,), "test", replica_gpus=((0,), (0,)))
    with pytest.raises(ConfigError, match=r"replicas sharing a GPU.*NCCL group"):
        make_plan(BackendRequest(merged, TrainerConfig(), layout=two_on_one), None, detect_gpus())
    check_cluster_sync(merged)  # Ray nodes meet the trainer's weight-update group over the network
    with pytest.raises(ConfigError, match=r"'disk' with cluster=.*use weight_sync_method='lora' or 'merged'"):
        check_cluster_sync(SGLangConfig(weight_sync_method="disk"))


def test_replicas_sharing_a_gpu_split_its_memory_and_each_gets_its_gpus(tmp_path):
    two_on_one = DeviceLayout(
        "split", "sglang", (0,), (1,), "test", cuda_ids=("GPU-aa11", "GPU-bb22"), replica_gpus=((0,), (0,))
    )
    backend = SGLangBackend(layout=two_on_one)
    assert backend.sglang_config.mem_fraction_static == 0.42  # an equal share of 85 %, when not set
    with pytest.raises(ConfigError, match=r"2 server replicas share a GPU.*mem_fraction_static <= 0.45"):
        SGLangBackend(layout=two_on_one, sglang_config=SGLangConfig(mem_fraction_static=0.6))
    # Behind the gateway the replicas have keys of their own; without it clients would meet the router.
    assert SGLangBackend(
        layout=two_on_one, sglang_config=SGLangConfig(api_key="secret")
    ).sglang_config.api_key
    with pytest.raises(ConfigError, match=r"api_key=\.\.\.\) with several server replicas and gateway=False"):
        SGLangBackend(layout=two_on_one, sglang_config=SGLangConfig(api_key="secret"), gateway=False)
    with pytest.raises(ConfigError, match=r"port=30000\) with several server replicas"):
        SGLangBackend(layout=two_on_one, sglang_config=SGLangConfig(port=30000))
    plan = _plan(two_on_one)
    # The second to start asks for 0.42 of what the first left: 0.42 of the whole GPU.
    assert [[c.mem_fraction_static for c in r.configs] for r in plan.replicas] == [[0.42, 0.724]] * 2
    service = InferenceService(plan, "m", log_path=tmp_path / "server.log")
    assert [p.environment()["CUDA_VISIBLE_DEVICES"] for p in service.processes] == ["GPU-aa11", "GPU-aa11"]
    assert [p.log_path.name for p in service.processes] == ["server.log", "server-replica1.log"]
    assert service.router is not None and service.router.log_path.name == "server-router.log"
    assert _children() == 0  # nothing started


def test_the_serving_plan_cannot_be_changed():
    plan = _plan(CPU_SHARED)
    with pytest.raises(ValidationError, match="frozen"):
        plan.release = "kv_cache"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        plan.server_config.mem_fraction_static = 0.5
    with pytest.raises(ValidationError, match="frozen"):
        plan.replicas[0].configs[0].server_env = {"X": "1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout.training_gpus = (1,)  # type: ignore[misc]


def test_cuda_mps_on_where_it_cannot_apply_is_refused(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="'auto', 'on' or 'off'"):
        SGLangBackend(engine="reference", cuda_mps="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_mps='on' applies to shared_strategy='co_resident' on SGLang"):
        SGLangBackend(layout=CPU_SHARED, shared_strategy="co_resident", cuda_mps="on")
    one_gpu = DeviceLayout("shared", "sglang", (0,), (0,), "forced for tests")
    with pytest.raises(ConfigError, match="cuda_mps='on' applies to shared_strategy='co_resident'"):
        SGLangBackend(layout=one_gpu, shared_strategy="sleep", cuda_mps="on")
    monkeypatch.setenv("PATH", str(tmp_path))  # no MPS control program
    with pytest.raises(ConfigError, match="cuda_mps='on' needs nvidia-cuda-mps-control"):
        SGLangBackend(layout=one_gpu, shared_strategy="co_resident", cuda_mps="on")
    # "auto" goes without it, and says so when the server starts.
    backend = SGLangBackend(layout=one_gpu, shared_strategy="co_resident", cuda_mps="auto")
    assert not backend.uses_cuda_mps


def test_a_cluster_without_ray_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray finds
    with pytest.raises(
        ConfigError, match=r"Ray is not installed.*pip install -e '\.\[ray\]' in the art_sglang checkout"
    ):
        SGLangBackend(cluster=art.ClusterConfig(gpus_per_replica=0))
