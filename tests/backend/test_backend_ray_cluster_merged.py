"""weight_sync_method="merged" with the inference replicas on a Ray cluster's nodes (a simulated cluster: a
head and two worker nodes, `ray.cluster_utils.Cluster`, one reference-engine replica on each): the trainer
on the head broadcasts each step's merged weights over a weight-update group that meets at the head's
address on the route to the nodes, and both replicas serve what peft's merged checkpoint of the step
serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from backend_helpers import cpu_replicas_on, simulated_ray_cluster
from merged_checks import forced_logprobs
from test_merged_group import _replica_logprobs
from test_merged_sync import BUCKET_BYTES, _train_step

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.orchestration.merge import merge
from art_sglang.serving.servers.client import ServerClient
from art_sglang.storage.model_store import ModelStore

pytest.importorskip("ray", reason="ray is in the dev extra (pip install -e '.[dev]')")
pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")

SLOT = "art_sglang_test_merged_replica"  # a worker node's custom resource: one replica each, none on the head
NODE = {"num_cpus": 0, "resources": {SLOT: 1}, "object_store_memory": 80 * 2**20}


async def test_replicas_on_cluster_nodes_serve_each_steps_merged_weights(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    met_at: list[str] = []
    join = ServerClient.init_weights_update_group

    async def recorded(self: ServerClient, address: str, *args: Any, **kwargs: Any) -> Any:
        met_at.append(address)
        return await join(self, address, *args, **kwargs)

    monkeypatch.setattr(ServerClient, "init_weights_update_group", recorded)
    path = tmp_path / ".art"
    with simulated_ray_cluster(NODE, object_store_memory=80 * 2**20) as cluster:
        config = cpu_replicas_on(cluster, SLOT, tmp_path)
        merged = SGLangConfig(weight_sync_method="merged", merged_bucket_bytes=BUCKET_BYTES)
        backend = SGLangBackend(path=str(path), engine="reference", cluster=config, sglang_config=merged)
        model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
        try:
            await model.register(backend)
            service = backend.inference
            assert service is not None
            replicas = list(service.processes)
            assert {r.node_id for r in replicas} == {node.node_id for node in cluster.worker_nodes}
            assert not [arg for r in replicas for arg in r.config.server_args("m", 1) if "lora" in arg]
            # The simulated nodes share this machine's network address: the nodes' address is the group's.
            [host] = {urlsplit(r.base_url).hostname for r in replicas}
            for seed in (1, 2):
                assert await _train_step(backend, model, seed) == seed
                first, second = await _replica_logprobs(service)
                assert first == second and first[1] == f"fused@{seed}"
            # One group, met where the nodes reach this machine, joined once by each replica.
            assert met_at == [host, host]

            # Step 2 as served is peft's merge of step 2, loaded from disk into the first replica.
            expected_dir = tmp_path / "peft-merged-2"
            merge(model.base_model, ModelStore(path, "merged", "fused").checkpoint_dir(2), expected_dir)
            await service.servers.live()[0].update_weights_from_disk(str(expected_dir))
            expected, _ = await forced_logprobs(replicas[0].base_url, None, replicas[0].config.api_key)
            assert first[0] == pytest.approx(expected, abs=1e-5)
        finally:
            await backend.close()
