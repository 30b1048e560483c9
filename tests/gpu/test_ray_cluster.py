"""Two SGLang replicas on two simulated Ray nodes that share the one GPU (`ray.cluster_utils.Cluster`, each
worker node offering GPU 0), SGLang's router checking them; the trainer on the same GPU. Through the backend with
`cluster=`: each step's adapter is shipped to both nodes and served by both (checksum of the head's files,
loaded from each node's own folder), the time from a finished step to its adapter loaded on both (put +
write + load) is recorded per step, one node removed without grace leaves the router while the other
serves the next step, a node added back gets a replica holding the current step, and rollout tokens/s
through the two Ray replicas are measured against the same two replicas started without Ray.

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu tests/gpu/test_ray_cluster.py   (stage.sh router and ray first; ~12 min:
    the suites ray-cluster-baseline and ray-cluster-1gpu run its two tests one per device call)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from gpu_helpers import make_groups, record, sglang_test_config

from art_sglang import ClusterConfig, SGLangBackend, TrainableModel
from art_sglang.planning.devices import DeviceLayout, detect_gpus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import (  # what each replica serves, asked of it directly; a Ray cluster in this box
    served_by_each,
    simulated_ray_cluster,
)

ray = pytest.importorskip("ray", reason="stage.sh ray puts Ray on the test process's path")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

SLOT = "art_sglang_gpu_replica"
NODE = {"num_cpus": 0, "num_gpus": 1, "resources": {SLOT: 1}, "object_store_memory": 512 * 2**20}
# Two replicas and the trainer on one GPU: a third of it each for the servers' weights and KV cache.
SERVER = {"mem_fraction_static": 0.3}
PROMPT = "Tell a long story about a robot that learns to paint, one sentence at a time."


@pytest.fixture(scope="module")
def model_path(gpu_model: str) -> str:
    return os.environ.get("ART_SGLANG_GPU_REALISTIC") or gpu_model


@pytest.fixture(scope="module")
def ray_cluster():
    with simulated_ray_cluster(NODE, num_gpus=0, object_store_memory=512 * 2**20) as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster_run(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, model_path: str):
    root = tmp_path_factory.mktemp("ray-gpu")
    config = ClusterConfig(address=ray_cluster.address, inference_replicas=2, replica_resources={SLOT: 1})
    backend = SGLangBackend(
        path=str(root / ".art"), sglang_config=sglang_test_config(**SERVER), cluster=config
    )
    model = TrainableModel(name="agent", project="ray-gpu", base_model=model_path)
    began = time.monotonic()
    try:
        await model.register(backend)
        record(
            "ray-cluster/register", seconds=round(time.monotonic() - began, 1), model=Path(model_path).name
        )
        yield backend, model
    finally:
        await backend.close()


def timed_adapter_loads(backend: SGLangBackend, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Seconds each adapter took from its checkpoint on the head to loaded on every replica (put into the
    object store, written on each node, path-loaded), filled in as steps publish."""
    service = backend.inference
    assert service is not None
    seconds: dict[str, float] = {}
    add = service.add_adapter

    async def timed(name: str, path: Path) -> None:
        began = time.monotonic()
        await add(name, path)
        seconds.setdefault(name, round(time.monotonic() - began, 3))

    monkeypatch.setattr(service, "add_adapter", timed)
    return seconds


async def train_step(backend: SGLangBackend, model: TrainableModel) -> int:
    groups = await make_groups(model.openai_client(), model.get_inference_name())
    return (await backend.train(model, groups, learning_rate=1e-4)).step


async def rollout_tokens_per_s(
    base_url: str, api_key: str, model: str, *, requests: int = 64, repeats: int = 3
) -> float:
    """Completion tokens per second of `requests` concurrent chat completions of 256 tokens: the median of
    `repeats` waves (one wave lasts a few seconds, too short to trust alone)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)

    async def one(n: int) -> int:
        messages = [{"role": "user", "content": f"{PROMPT} ({n})"}]
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=256, temperature=1.0, extra_body={"ignore_eos": True}
        )
        return reply.usage.completion_tokens if reply.usage is not None else 0

    rates = []
    for wave in range(repeats):
        began = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(wave * requests + n) for n in range(requests))))
        rates.append(tokens / (time.monotonic() - began))
    return statistics.median(rates)


async def test_rollout_speed_of_the_same_two_replicas_without_ray(tmp_path: Path, model_path: str) -> None:
    """The baseline: the same two replicas on GPU 0 started by the backend itself, before the Ray ones (the
    trainer on CPU, as in test_replicas.py: this run measures rollouts only). First in the module, so the
    GPU is free; `-k without_ray` runs it alone (the two tests do not fit one 10-minute device call)."""
    gpus = detect_gpus().gpus
    layout = DeviceLayout("split", "sglang", (0,), (), "baseline: two local replicas on GPU 0",
                          cuda_ids=tuple(g.cuda_id for g in gpus), replica_gpus=((0,), (0,)))  # fmt: skip
    local = SGLangBackend(
        layout=layout, sglang_config=sglang_test_config(**SERVER), path=str(tmp_path / ".art")
    )
    model = TrainableModel(name="agent", project="ray-gpu-baseline", base_model=model_path)
    try:
        await model.register(local)
        assert local.inference is not None
        service = local.inference
        tokens_per_s = await rollout_tokens_per_s(
            service.openai_base_url, service.api_key, model.get_inference_name()
        )
    finally:
        await local.close()
    record("ray-cluster/baseline", rollout_tokens_per_s_without_ray=round(tokens_per_s, 1))


async def test_steps_reach_both_nodes_and_a_lost_node_is_replaced(
    cluster_run: tuple[SGLangBackend, TrainableModel], ray_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model = cluster_run
    service = backend.inference
    assert service is not None and service.router is not None
    loads = timed_adapter_loads(backend, monkeypatch)
    replicas: list[Any] = list(service.processes)
    assert {r.node_id for r in replicas} == {n.node_id for n in ray_cluster.worker_nodes}
    for expected in (1, 2):
        assert await train_step(backend, model) == expected
        name = f"agent@{expected}"
        assert await served_by_each(service, name) == ["yes", "yes"]
        assert len({r.staged[name] for r in replicas}) == 1
    tokens_per_s = await rollout_tokens_per_s(
        service.openai_base_url, service.api_key, model.get_inference_name()
    )
    record("ray-cluster/steps", adapter_to_both_replicas_s=loads, rollout_tokens_per_s=round(tokens_per_s, 1))

    victim, survivor = replicas
    victim_url = victim.base_url  # the handle forgets its address once the backend restarts it
    node = next(n for n in ray_cluster.worker_nodes if n.node_id == victim.node_id)
    lost = time.monotonic()
    ray_cluster.remove_node(node, allow_graceful=False)
    while victim_url in await service.router.workers():
        assert time.monotonic() - lost < 10, "the router still lists the lost node's replica"
        await asyncio.sleep(0.05)
    left_router_s = round(time.monotonic() - lost, 2)
    assert await train_step(backend, model) == 3
    assert await served_by_each(service, "agent@3", [survivor]) == ["yes"]
    added = ray_cluster.add_node(**NODE)
    began = time.monotonic()
    while len(await service.router.workers()) < 2:
        assert time.monotonic() - began < 300, "no replica was placed on the new node"
        await asyncio.sleep(0.5)
    assert {r.node_id for r in service.processes} >= {added.node_id}
    assert await served_by_each(service, "agent@3") == ["yes", "yes"]
    record("ray-cluster/node-loss", left_router_s=left_router_s,
           replaced_in_router_s=round(time.monotonic() - began, 1))  # fmt: skip
