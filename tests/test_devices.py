"""GPU discovery through a real nvidia-smi subprocess (a script printing nvidia-smi's CSV, first on PATH),
CUDA_VISIBLE_DEVICES handling, and the split/shared/cpu layout with every configuration error."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from pathlib import Path

import pytest

from art_sglang.config import DeviceConfig
from art_sglang.errors import ConfigError
from art_sglang.planning.devices import (
    DeviceLayout,
    Discovery,
    EngineChoice,
    apply_cuda_visible_devices,
    choose_layout,
    detect_gpus,
    device_request,
    parse_nvidia_smi,
)


def layout_for(
    config: DeviceConfig | None = None,
    *,
    discovery: Discovery,
    engine: EngineChoice = "auto",
    tensor_parallel_size: int = 1,
    **gpus: int | list[int],
) -> DeviceLayout:
    """The layout SGLangBackend(device_config=config, **gpus) chooses: its GPU arguments are sugar for a
    DeviceConfig."""
    request = device_request(config, "SGLangBackend's arguments", **gpus)
    return choose_layout(
        request, engine=engine, tensor_parallel_size=tensor_parallel_size, discovery=discovery
    )


FOUR_GPUS = """\
0, GPU-11111111-aaaa, NVIDIA H100 80GB HBM3, 81559, 1
1, GPU-22222222-bbbb, NVIDIA H100 80GB HBM3, 81559, 500
2, GPU-22223333-cccc, NVIDIA H100 80GB HBM3, 81559, 0
3, GPU-44444444-dddd, NVIDIA A100-SXM4-80GB, 81920, [N/A]
"""


def fake_nvidia_smi(folder: Path, stdout: str = FOUR_GPUS, exit_code: int = 0, stderr: str = "") -> Path:
    """An executable named nvidia-smi that answers like the real one (and checks it was asked for CSV)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"--format=csv,noheader,nounits"*) ;; *) echo "bad args: $*" >&2; exit 2;; esac\n'
        f"cat <<'EOF'\n{stdout}EOF\n"
        f"echo {shlex.quote(stderr)} >&2\n"
        f"exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Put a fake nvidia-smi with the given output first on PATH."""

    def install(**kwargs) -> Path:
        script = fake_nvidia_smi(tmp_path / "bin", **kwargs)
        monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
        return script

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


def test_detects_gpus_from_nvidia_smi_on_path(on_path):
    on_path()
    found = detect_gpus()
    assert [g.index for g in found.gpus] == [0, 1, 2, 3]
    first, last = found.gpus[0], found.gpus[3]
    assert (first.name, first.memory_total_mib, first.memory_used_mib) == ("NVIDIA H100 80GB HBM3", 81559, 1)
    assert first.uuid == "GPU-11111111-aaaa" and first.cuda_id == "0"
    assert last.name == "NVIDIA A100-SXM4-80GB" and last.memory_used_mib == 0  # [N/A]
    assert "4 visible" in found.detail and "CUDA_VISIBLE_DEVICES unset" in found.detail


def test_nvidia_smi_path_is_injectable(tmp_path):
    script = fake_nvidia_smi(tmp_path, stdout="0, GPU-x, Tesla T4, 15360, 0\n")
    found = detect_gpus(str(script), environ={})
    assert [(g.index, g.name) for g in found.gpus] == [(0, "Tesla T4")]


def test_failing_or_missing_nvidia_smi_means_no_gpu(on_path, tmp_path):
    on_path(
        stdout="", exit_code=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with the driver"
    )
    failed = detect_gpus()
    assert failed.gpus == ()
    assert "exit 9" in failed.detail and "couldn't communicate" in failed.detail
    missing = detect_gpus(str(tmp_path / "no-such-nvidia-smi"))
    assert missing.gpus == () and "not found" in missing.detail


def test_unexpected_output_means_no_gpu(on_path):
    on_path(stdout="Field 'uuid' is not a valid field to query.\n")
    found = detect_gpus()
    assert found.gpus == () and "printed something unexpected" in found.detail
    assert "Field 'uuid'" in found.detail


def test_this_machine():
    found = detect_gpus()
    if shutil.which("nvidia-smi") is None:
        assert found.gpus == () and "not found" in found.detail
        layout = choose_layout(discovery=found)
        assert (layout.mode, layout.engine) == ("cpu", "reference")
    else:
        assert all(g.index == i for i, g in enumerate(found.gpus))


def test_gpu_names_with_commas():
    [gpu] = parse_nvidia_smi("7, GPU-z, Some GPU, Rev 2, 1024, 12\n")
    assert (gpu.index, gpu.name, gpu.memory_total_mib, gpu.memory_used_mib) == (
        7,
        "Some GPU, Rev 2",
        1024,
        12,
    )


@pytest.mark.parametrize(
    ("setting", "physical", "cuda_ids"),
    [
        (None, [0, 1, 2, 3], ["0", "1", "2", "3"]),
        ("", [], []),
        ("-1", [], []),
        ("2,0", [2, 0], ["2", "0"]),
        (" 3 , 1 ", [3, 1], ["3", "1"]),
        ("1,9,0", [1], ["1"]),  # CUDA stops at the first entry that names no GPU
        ("0,0,1", [0], ["0"]),  # ... or repeats one
        ("GPU-4444,GPU-11111111-aaaa", [3, 0], ["GPU-44444444-dddd", "GPU-11111111-aaaa"]),
        ("GPU-2222,0", [], []),  # an ambiguous UUID prefix names no GPU
        ("MIG-abc", [], []),
    ],
)
def test_cuda_visible_devices(setting, physical, cuda_ids, on_path, monkeypatch):
    gpus = parse_nvidia_smi(FOUR_GPUS)
    visible = apply_cuda_visible_devices(gpus, setting)
    assert [g.physical_index for g in visible] == physical
    assert [g.index for g in visible] == list(range(len(physical)))  # renumbered as CUDA does
    assert [g.cuda_id for g in visible] == cuda_ids
    if setting is not None:  # the same through the environment and a real nvidia-smi process
        on_path()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", setting)
        found = detect_gpus()
        assert [g.physical_index for g in found.gpus] == physical
        assert f"CUDA_VISIBLE_DEVICES={setting!r}" in found.detail


def visible(count: int, setting: str | None = None) -> Discovery:
    gpus = apply_cuda_visible_devices(parse_nvidia_smi(FOUR_GPUS)[:count], setting)
    return Discovery(gpus, f"{count} GPU(s) in nvidia-smi", setting)


NO_GPU = Discovery((), "nvidia-smi not found")


@pytest.mark.parametrize(
    ("count", "tp", "mode", "inference", "training"),
    [
        (4, 1, "split", (0,), (1, 2, 3)),
        (2, 1, "split", (0,), (1,)),
        (1, 1, "shared", (0,), (0,)),
        (4, 2, "split", (0, 1), (2, 3)),
        (2, 2, "shared", (0, 1), (0, 1)),
    ],
)
def test_auto_layout_follows_the_gpu_count(count, tp, mode, inference, training):
    layout = choose_layout(discovery=visible(count), tensor_parallel_size=tp)
    assert (layout.mode, layout.engine, layout.inference_gpus, layout.training_gpus) == (
        mode,
        "sglang",
        inference,
        training,
    )
    assert layout.describe().startswith(f"{mode} mode, sglang engine: inference on GPU ")
    assert "\n" not in layout.describe()


def test_no_gpu_means_reference_engine_on_cpu():
    layout = choose_layout(discovery=NO_GPU)
    assert (layout.mode, layout.engine, layout.inference_gpus, layout.training_gpus) == (
        "cpu",
        "reference",
        (),
        (),
    )
    assert layout.describe() == (
        "cpu mode, reference engine: inference and training on CPU (no GPU visible: nvidia-smi not found)"
    )
    assert layout.cuda_visible_devices("inference") == layout.cuda_visible_devices("training") == ""


def test_reference_engine_can_be_forced_with_gpus():
    layout = choose_layout(discovery=visible(2), engine="reference")
    assert (layout.mode, layout.engine) == ("cpu", "reference")
    assert "engine='reference'" in layout.describe()


@pytest.mark.parametrize(
    ("kwargs", "config", "inference", "training", "mode"),
    [
        ({"inference_device": 1, "training_devices": [0]}, None, (1,), (0,), "split"),
        ({"inference_device": 2}, None, (2,), (0, 1, 3), "split"),
        ({"training_devices": [2, 3]}, None, (0,), (2, 3), "split"),
        ({"training_devices": [0]}, None, (1,), (0,), "split"),
        ({"inference_device": 0, "training_devices": [0]}, None, (0,), (0,), "shared"),
        ({}, DeviceConfig(inference_device=3, training_devices=[1]), (3,), (1,), "split"),
        ({}, DeviceConfig(inference_device=1), (1,), (0, 2, 3), "split"),
        ({}, DeviceConfig(auto_detect=False), (0,), (1,), "split"),
    ],
)
def test_explicit_settings_win_over_detection(kwargs, config, inference, training, mode):
    layout = layout_for(config, discovery=visible(4), **kwargs)
    assert (layout.mode, layout.inference_gpus, layout.training_gpus) == (mode, inference, training)


def test_one_gpu_with_only_training_set_shares_it():
    layout = layout_for(discovery=visible(1), training_devices=[0])
    assert (layout.mode, layout.inference_gpus, layout.training_gpus) == ("shared", (0,), (0,))


def test_children_get_the_parents_gpu_names():
    layout = layout_for(discovery=visible(4, "3,1,2"), inference_device=0, training_devices=[2, 1])
    assert layout.cuda_visible_devices("inference") == "3"
    assert layout.cuda_visible_devices("training") == "2,1"
    by_uuid = choose_layout(discovery=visible(4, "GPU-44444444,GPU-11111111"))
    assert by_uuid.cuda_visible_devices("inference") == "GPU-44444444-dddd"
    assert by_uuid.cuda_visible_devices("training") == "GPU-11111111-aaaa"


def test_auto_detect_off_trusts_the_config_without_gpus_found():
    config = DeviceConfig(inference_device=1, training_devices=[0], auto_detect=False)
    layout = choose_layout(config, discovery=NO_GPU)
    assert (layout.mode, layout.engine, layout.inference_gpus, layout.training_gpus) == (
        "split",
        "sglang",
        (1,),
        (0,),
    )
    assert layout.cuda_visible_devices("inference") == "1"
    # With CUDA_VISIBLE_DEVICES set in this process, children get the GPUs it names.
    hidden = Discovery((), "nvidia-smi not found", "6,7")
    assert choose_layout(config, discovery=hidden).cuda_visible_devices("training") == "6"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: layout_for(discovery=visible(2), inference_device=0, training_devices=[0, 1]),
            "GPU 0 is set for both inference (GPU 0) and training (GPU 0,1); in split mode they must be "
            "different GPUs: remove it from training_devices, or set training_devices=[0] for shared mode",
        ),
        (
            lambda: choose_layout(
                DeviceConfig(inference_device=1, training_devices=[]), discovery=visible(2)
            ),
            "training_devices is empty: list at least one GPU for training, e.g. training_devices=[0] "
            "(split mode), or training_devices=[1] to share the inference GPU",
        ),
        (
            lambda: layout_for(discovery=visible(3), inference_device=0, training_devices=[1, 2, 1]),
            "training_devices=[1, 2, 1] lists GPU 1 more than once: list each training GPU once",
        ),
        (
            lambda: layout_for(discovery=visible(2), inference_device=0, training_devices=[1, 5]),
            "GPU 5 does not exist: 2 GPU(s) (NVIDIA H100 80GB HBM3) visible, numbered 0..1",
        ),
        (
            lambda: layout_for(discovery=visible(4, "2,3"), inference_device=2, training_devices=[0]),
            "GPU 2 does not exist: 2 GPU(s) (NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3) visible, "
            "numbered 0..1 (4 GPU(s) in nvidia-smi); use indices in that range (they count only the GPUs "
            "CUDA_VISIBLE_DEVICES shows)",
        ),
        (
            lambda: choose_layout(
                DeviceConfig(inference_device=0, training_devices=[3], auto_detect=False),
                discovery=Discovery((), "nvidia-smi not found", "4,5"),
            ),
            "GPU 3 does not exist: CUDA_VISIBLE_DEVICES='4,5' shows 2, numbered 0..1",
        ),
        (
            lambda: layout_for(DeviceConfig(inference_device=3), discovery=visible(4), training_devices=[2]),
            "GPUs are set twice: SGLangBackend's arguments set training_devices, and device_config sets "
            "inference_device: set the GPUs in one place",
        ),
        (
            lambda: layout_for(discovery=visible(2), inference_device=-1),
            "SGLangBackend's arguments: inference_device=-1: Input should be greater than or equal to 0",
        ),
        (
            lambda: choose_layout(discovery=NO_GPU, engine="sglang"),
            "engine='sglang' but no GPU is visible (nvidia-smi not found); check the driver and "
            "CUDA_VISIBLE_DEVICES, use engine='reference' to run on CPU, or set "
            "DeviceConfig(auto_detect=False, ...) to use the given GPU indices without detection",
        ),
        (
            lambda: layout_for(discovery=NO_GPU, inference_device=0, training_devices=[1]),
            "inference_device/training_devices were set but no GPU is visible (nvidia-smi not found); check "
            "the driver and CUDA_VISIBLE_DEVICES, leave out inference_device/training_devices to run on CPU",
        ),
        (
            lambda: layout_for(discovery=NO_GPU, engine="sglang", inference_device=0, training_devices=[1]),
            "use engine='reference' without inference_device/training_devices to run on CPU",
        ),
        (
            lambda: layout_for(discovery=visible(2), engine="reference", training_devices=[1]),
            "engine='reference' runs on CPU, but GPUs were set (inference_device/training_devices): "
            "drop them, or use engine='sglang'",
        ),
        (
            lambda: choose_layout(discovery=visible(2), tensor_parallel_size=4),
            "tensor_parallel_size=4 needs 4 GPUs but 2 are visible (2 GPU(s) in nvidia-smi); "
            "lower tensor_parallel_size",
        ),
        (
            lambda: layout_for(discovery=visible(4), inference_devices=[0, 1], tensor_parallel_size=2),
            "server replicas on GPU 0,1 and GPU 1,2 (tensor_parallel_size=2) partly overlap: start replicas "
            "2 GPUs apart, or at the same GPU to share it",
        ),
        (
            lambda: layout_for(discovery=visible(2), inference_devices=[0, 1], training_devices=[0, 1]),
            "inference_devices=[0, 1] starts 2 server replicas on the training GPU(s) 0,1: replicas need "
            "split mode, give training its own GPU(s) in training_devices",
        ),
        (
            lambda: layout_for(discovery=visible(4), inference_device=0, inference_devices=[0, 1]),
            "both inference_device and inference_devices are set: use inference_devices alone",
        ),
        (
            lambda: layout_for(discovery=visible(2), inference_devices=[0, 2]),
            "GPU 2 does not exist: 2 GPU(s) (NVIDIA H100 80GB HBM3) visible, numbered 0..1",
        ),
        (
            lambda: layout_for(discovery=visible(2), inference_devices=[]),
            "inference_devices is empty: list the first GPU of each server replica",
        ),
        (
            lambda: layout_for(discovery=visible(2), engine="reference", inference_devices=[0, 0]),
            "engine='reference' runs on CPU, but GPUs were set",
        ),
    ],
)
def test_impossible_settings_fail_with_the_fix(call, message):
    with pytest.raises(ConfigError) as error:
        call()
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("asked", "advised"),
    [
        ({"engine": "sglang"}, {"engine": "reference"}),
        ({"inference_device": 0, "training_devices": [1, 2, 3]}, {}),
        ({"engine": "sglang", "inference_device": 0, "training_devices": [1]}, {"engine": "reference"}),
    ],
)
def test_the_no_gpu_error_advises_settings_that_run_on_cpu(asked, advised):
    # Its advice, followed to the letter, must not lead into the next ConfigError (engine='reference' refuses
    # GPU indices, so "use engine='reference'" alone was not enough when GPUs were set).
    with pytest.raises(ConfigError) as error:
        layout_for(discovery=NO_GPU, **asked)
    message = str(error.value)
    assert ("use engine='reference'" in message) == ("engine" in advised)
    assert ("leave out inference_device/training_devices" in message) == ("engine" not in advised)
    assert layout_for(discovery=NO_GPU, **advised).mode == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "config", "replicas", "training", "role_line"),
    [
        (
            {"inference_devices": [0, 1]},
            None,
            ((0,), (1,)),
            (2, 3),
            "inference replica 0 on GPU 0, replica 1 on GPU 1 (behind SGLang's router), training ranks 0 on GPU 2, "
            "1 on GPU 3",
        ),
        (
            {"inference_devices": [0, 0], "training_devices": [1]},
            None,
            ((0,), (0,)),
            (1,),
            "inference replica 0 on GPU 0, replica 1 on GPU 0 (behind SGLang's router), training on GPU 1",
        ),
        (
            {"tensor_parallel_size": 2},
            DeviceConfig(inference_devices=[0, 0], training_devices=[2, 3]),
            ((0, 1), (0, 1)),
            (2, 3),
            "inference replica 0 on GPU 0,1, replica 1 on GPU 0,1 (behind SGLang's router), training ranks 0 on "
            "GPU 2, 1 on GPU 3",
        ),
    ],
)
def test_inference_devices_start_one_replica_per_gpu_listed(kwargs, config, replicas, training, role_line):
    layout = layout_for(config, discovery=visible(4), **kwargs)
    assert (layout.mode, layout.replicas, layout.training_gpus) == ("split", replicas, training)
    assert layout.inference_gpus == tuple(sorted({g for gpus in replicas for g in gpus}))
    assert layout.describe() == f"split mode, sglang engine: {role_line} (GPUs set explicitly)"
    assert [layout.cuda_names(gpus) for gpus in layout.replicas] == [",".join(map(str, g)) for g in replicas]


def test_one_listed_inference_device_is_one_server():
    layout = layout_for(discovery=visible(2), inference_devices=[1])
    assert (layout.replicas, layout.replica_gpus, layout.training_gpus) == (((1,),), (), (0,))
    assert "replica" not in layout.describe()


def test_layout_line_names_each_training_rank_gpu():
    layout = layout_for(discovery=visible(4), inference_device=0, training_devices=[1, 2, 3])
    assert layout.describe() == (
        "split mode, sglang engine: inference on GPU 0, training ranks 0 on GPU 1, 1 on GPU 2, 2 on GPU 3 "
        "(GPUs set explicitly)"
    )
    one = layout_for(discovery=visible(2), inference_device=0, training_devices=[1])
    assert "inference on GPU 0, training on GPU 1 (" in one.describe()
