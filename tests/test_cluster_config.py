"""`cluster=`: what the plan holds, the settings refused before anything starts, the one-machine path never
importing Ray, and an adapter's files written on a node exactly as read on the head."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from art_sglang import ClusterConfig, ConfigError, SGLangBackend, SGLangConfig
from art_sglang.cluster.files import adapter_version, checksum, read_adapter, remove_adapter, write_adapter
from art_sglang.config import TrainerConfig
from art_sglang.planning.devices import DeviceLayout, detect_gpus
from art_sglang.planning.make_plan import make_plan
from art_sglang.planning.request import BackendRequest
from art_sglang.planning.serving_plan import ServingPlan


def plan(**kwargs) -> ServingPlan:
    config = kwargs.pop("config", SGLangConfig())
    return make_plan(
        BackendRequest(config, TrainerConfig(), engine="reference", **kwargs), None, detect_gpus()
    )


def test_a_cluster_is_planned_with_its_replicas_behind_the_router() -> None:
    three = plan(cluster=ClusterConfig(inference_replicas=3, gpus_per_replica=0))
    assert three.cluster is not None and three.cluster.inference_replicas == 3
    assert len(three.replicas) == 3 and all(replica.gpu_ids == () for replica in three.replicas)
    assert three.handoff == "none" and three.routed
    one = plan(cluster=ClusterConfig(address="auto"))  # the address alone: one replica, still routed
    assert one.cluster == ClusterConfig(address="auto") and len(one.replicas) == 1 and one.routed
    assert not plan().routed


def test_the_layout_line_of_a_gpu_head_says_where_inference_runs() -> None:
    layout = DeviceLayout("split", "sglang", (), (0, 1), "on a cluster", ("0", "1"), replica_gpus=((), ()))
    assert layout.describe() == (
        "split mode, sglang engine: inference on other machines, training ranks 0 on GPU 0, 1 on GPU 1 "
        "(on a cluster)"
    )


def test_settings_a_cluster_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="cluster= places the inference replicas"):
        SGLangBackend(engine="reference", inference_devices=[0, 1], cluster="auto")
    disk = BackendRequest(
        SGLangConfig(weight_sync_method="disk"), TrainerConfig(), engine="reference", cluster=ClusterConfig()
    )
    with pytest.raises(ConfigError, match="use weight_sync_method='lora'"):
        make_plan(disk, None, detect_gpus())
    with pytest.raises(ConfigError, match=r"gpus_per_replica=1.*tensor_parallel_size=2"):
        SGLangBackend(engine="sglang", sglang_config=SGLangConfig(tensor_parallel_size=2), cluster="auto")


def test_the_one_machine_path_never_imports_ray() -> None:
    code = (
        "import sys, art_sglang as art\n"
        "art.SGLangBackend(engine='reference')\n"
        "art.SGLangBackend(engine='reference', cluster=art.ClusterConfig(gpus_per_replica=0))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_an_adapter_is_written_whole_with_the_checksum_of_what_was_read(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "adapter_config.json").write_text('{"r": 8}')
    (checkpoint / "adapter_model.safetensors").write_bytes(b"\x00weights" * 100)
    (checkpoint / "optimizer.pt").write_bytes(b"not shipped")
    files = read_adapter(checkpoint)
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    node = tmp_path / "node"
    path, digest = write_adapter(node, "agent@1", files)
    assert path == node / "agent@1" and digest == checksum(files)
    assert sorted(p.name for p in node.iterdir()) == ["agent@1"]  # no staging folder left
    # Shipped again (a replaced step), the new files win.
    files["adapter_model.safetensors"] = b"\x01other" * 100
    assert write_adapter(node, "agent@1", files)[1] == checksum(files) != digest
    remove_adapter(node, "agent@1")
    assert list(node.iterdir()) == []


def test_a_checkpoint_written_again_under_its_path_is_a_new_version(tmp_path: Path) -> None:
    """A refused step's folder is written again by the next train(): the bytes shipped must be the new."""
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"first")
    first = adapter_version(tmp_path)
    assert adapter_version(tmp_path) == first
    (tmp_path / "adapter_model.safetensors").write_bytes(b"written again")
    assert adapter_version(tmp_path) != first


async def test_with_a_shared_filesystem_the_checkpoint_path_is_loaded_as_is(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="ray is in the dev extra")
    from art_sglang.cluster import ray_cluster

    cluster = ray_cluster(ClusterConfig(shared_filesystem=True))
    server = cluster.server(
        SGLangConfig(), "model", engine="reference", admin_api_key="k", env=None, label="replica"
    )
    assert await server.stage("agent@1", tmp_path) == str(tmp_path)  # nothing shipped, no actor asked
    assert server.staged == {}
