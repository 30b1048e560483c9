"""SGLangConfig.lora_experimental_path, SGLang 0.5.17's experimental triton LoRA path: its variables reach
the launched server's environment, it is refused without the triton backend or with a LoRA pool wider than
the trainer's rank, and an adapter of another rank is refused before a server sees it (the path computes
NaN for one: 39f section 5)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from art_sglang import ConfigError, SGLangBackend, SGLangConfig, TrainerConfig
from art_sglang.errors import AdapterLoadError
from art_sglang.planning.config_checks import check_compatible
from art_sglang.planning.devices import DeviceLayout, detect_gpus
from art_sglang.planning.make_plan import make_plan
from art_sglang.planning.request import BackendRequest
from art_sglang.serving.adapters import InferenceService
from art_sglang.serving.servers.process import ServerProcess
from art_sglang.sglang_env import EXPERIMENTAL_LORA_ENV
from art_sglang.storage.model_store import check_adapter

CPU_SHARED = DeviceLayout("shared", "reference", (), (), "forced for tests")
EXPERIMENTAL = {"lora_backend": "triton", "lora_experimental_path": True}


def _adapter(folder: Path, rank: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def _experimental(environment: dict[str, str]) -> dict[str, str]:
    return {name: environment[name] for name in EXPERIMENTAL_LORA_ENV if name in environment}


async def test_the_variables_reach_the_launched_server(tmp_path: Path, tiny_model_path: Path) -> None:
    """The server a backend's plan launches (the reference engine, which takes --lora-backend triton as
    SGLang does) runs with both variables; without the path, or with merged weights (no LoRA), with neither."""
    request = BackendRequest(
        SGLangConfig(**EXPERIMENTAL, server_timeout=120), TrainerConfig(), layout=CPU_SHARED
    )
    plan = make_plan(request, None, detect_gpus())
    assert plan.server_config.max_lora_rank == 8
    [server] = InferenceService(plan, str(tiny_model_path), log_path=tmp_path / "server.log").processes
    await server.start()
    try:
        assert "--lora-backend triton" in " ".join(server.command()) and server.pid is not None
        assert _experimental(psutil.Process(server.pid).environ()) == EXPERIMENTAL_LORA_ENV
    finally:
        await server.stop()
    for config in (
        SGLangConfig(lora_backend="csgmv"),  # the path is the triton backend's only
        SGLangConfig(**EXPERIMENTAL, weight_sync_method="merged"),
    ):
        process = ServerProcess(config, "m", engine="sglang", log_path=tmp_path / "s.log")
        assert _experimental(process.environment()) == {}


def test_the_path_needs_the_triton_backend_and_the_trainers_rank(tmp_path: Path) -> None:
    csgmv = SGLangConfig(lora_backend="csgmv", lora_experimental_path=True)
    with pytest.raises(ConfigError, match=r"lora_experimental_path=True\) runs .* not lora_backend='csgmv'"):
        SGLangBackend(engine="reference", sglang_config=csgmv)
    with pytest.raises(
        ConfigError, match=r"lora_rank=16\) is not max_lora_rank=64.*leave max_lora_rank unset"
    ):
        SGLangBackend(
            engine="reference",
            sglang_config=SGLangConfig(**EXPERIMENTAL, max_lora_rank=64),
            trainer_config=TrainerConfig(lora_rank=16),
        )
    backend = SGLangBackend(
        engine="reference",
        sglang_config=SGLangConfig(**EXPERIMENTAL),
        trainer_config=TrainerConfig(lora_rank=16),
    )
    assert backend.sglang_config.max_lora_rank == 16
    # A later model of a lower rank is refused by the running server's settings (a higher one by any pool).
    with pytest.raises(ConfigError, match=r"lora_rank=8\) is not max_lora_rank=16"):
        check_compatible(backend.sglang_config, TrainerConfig(lora_rank=8))
    # Merged weights serve no adapter: the path's rules do not apply.
    merged = SGLangConfig(lora_experimental_path=True, max_lora_rank=64, weight_sync_method="merged")
    check_compatible(merged, TrainerConfig(lora_rank=16))


def test_left_unset_the_path_runs_where_it_can() -> None:
    """The default (None) is settled by the plan: on with the triton backend and a pool of the trainer's rank,
    off (and no error) with a wider pool or other kernels; once on, a later model of another rank is refused
    as an explicit True is."""
    trainer = TrainerConfig(lora_rank=16)
    settled = {}
    for name, config in [
        ("default", SGLangConfig()),
        ("wider pool", SGLangConfig(max_lora_rank=64)),
        ("csgmv", SGLangConfig(lora_backend="csgmv")),
        ("sglang's own", SGLangConfig(lora_backend=None)),
    ]:
        backend = SGLangBackend(engine="reference", sglang_config=config, trainer_config=trainer)
        settled[name] = backend.sglang_config.lora_experimental_path
        assert backend.sglang_config.experimental_lora_served is settled[name]
    assert settled == {"default": True, "wider pool": False, "csgmv": False, "sglang's own": False}
    default = SGLangBackend(engine="reference", trainer_config=trainer).sglang_config
    assert default.max_lora_rank == 16
    with pytest.raises(ConfigError, match=r"lora_rank=8\) is not max_lora_rank=16"):
        check_compatible(default, TrainerConfig(lora_rank=8))


async def test_an_adapter_of_another_rank_is_refused_before_any_server_sees_it(tmp_path: Path) -> None:
    request = BackendRequest(SGLangConfig(**EXPERIMENTAL), TrainerConfig(lora_rank=16), layout=CPU_SHARED)
    service = InferenceService(make_plan(request, None, detect_gpus()), "m", log_path=tmp_path / "server.log")
    lower = _adapter(tmp_path / "r8", 8)
    with pytest.raises(
        AdapterLoadError, match=r"rank 8, and the server runs .*experimental.*max_lora_rank=16"
    ):
        await service.add_adapter("m@1", lower)
    assert service.servers.processes[0].pid is None  # refused here, nothing started
    check_adapter(_adapter(tmp_path / "r16", 16), request.sglang.model_copy(update={"max_lora_rank": 16}))
    # Without the path a narrower adapter fits the pool.
    check_adapter(lower, SGLangConfig(max_lora_rank=16, lora_experimental_path=False))
