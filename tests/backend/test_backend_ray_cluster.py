"""Inference replicas on the nodes of a Ray cluster, through the backend: a simulated cluster (a head and
two worker nodes, `ray.cluster_utils.Cluster`) whose worker nodes each hold one reference-engine replica
behind SGLang's real router. Adapters reach the nodes as bytes, never as the head's checkpoint path: each
replica loads them from its own node-local folder, with the checksum of the head's files. A node removed
without grace mid-rollout leaves the router within 10 s, rollouts and the next step go on on the other,
and a node added back gets a replica holding the current step before the router lists it. One backend for
the module; the tests run in order."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import pytest_asyncio
from backend_helpers import (
    bearer,
    chat_lines,
    check_requests_follow_loads,
    cpu_replicas_on,
    sample_groups,
    served_by_each,
    simulated_ray_cluster,
)

import art_sglang as art
from art_sglang import ClusterConfig, SGLangBackend
from art_sglang.errors import ServerCrashedError, ServerStartError
from art_sglang.serving.adapters import InferenceService

ray = pytest.importorskip("ray", reason="ray is in the dev extra (pip install -e '.[dev]')")
pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")
from ray.cluster_utils import Cluster  # noqa: E402

from art_sglang.cluster.files import checksum, read_adapter  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOT = "art_sglang_test_replica"  # a worker node's custom resource: one replica each, none on the head
NODE = {"num_cpus": 0, "resources": {SLOT: 1}, "object_store_memory": 80 * 2**20}


@dataclass
class Run:
    cluster: Cluster
    backend: SGLangBackend
    model: art.TrainableModel
    checkpoints: Path

    @property
    def service(self) -> InferenceService:
        assert self.backend.inference is not None
        return self.backend.inference

    def replicas(self) -> list[Any]:
        return list(self.service.processes)


@pytest.fixture(scope="module")
def ray_cluster():
    with simulated_ray_cluster(NODE, object_store_memory=80 * 2**20) as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    root = tmp_path_factory.mktemp("ray-cluster")
    config = cpu_replicas_on(ray_cluster, SLOT, root)
    backend = SGLangBackend(path=str(root / ".art"), engine="reference", cluster=config)
    model = art.TrainableModel(name="agent", project="cluster", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield Run(ray_cluster, backend, model, root / ".art")
    finally:
        await backend.close()


async def loaded_paths(replica: Any) -> dict[str, str]:
    """Adapter name -> the path the replica's server loaded it from (GET /v1/models, `root`)."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        models = await http.get(f"{replica.base_url}/v1/models", headers=bearer(replica.config.api_key))
    return {card["id"]: card["root"] for card in models.json()["data"] if card.get("parent")}


async def check_held_everywhere(run: Run, name: str, replicas: list[Any]) -> None:
    """`name` is served by each replica, from the replica's own node-local folder, with the checksum of
    the head's checkpoint files."""
    step = int(name.rsplit("@", 1)[1])
    head_files = run.backend._entry(run.model).store.checkpoint_dir(step)
    expected = checksum(read_adapter(head_files))
    assert await served_by_each(run.service, name, replicas) == ["yes"] * len(replicas)
    for replica in replicas:
        assert replica.staged[name] == expected
        where = Path((await loaded_paths(replica))[name])
        assert where.parent == replica.adapter_dir
        assert run.checkpoints not in where.parents


def replica_processes() -> list[str]:
    """The replicas' actors and servers among this test's processes (the simulated nodes are its children)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(process.cmdline())
            if "art_sglang_reference" in line or "ReplicaHost" in line:
                found.append(line[:100])
    return found


async def train_step(run: Run, seed: int) -> int:
    groups = await sample_groups(run.model, seed=seed)
    return (await run.backend.train(run.model, groups, learning_rate=1e-3)).step


async def test_each_replica_runs_on_its_own_worker_node(run: Run) -> None:
    replicas = run.replicas()
    workers = {node.node_id for node in run.cluster.worker_nodes}
    assert {replica.node_id for replica in replicas} == workers  # one on each, none on the head
    assert len({replica.adapter_dir for replica in replicas}) == 2
    router = run.service.router
    assert router is not None
    assert await router.workers() == {replica.base_url: True for replica in replicas}
    await check_held_everywhere(run, "agent@0", replicas)
    # They listen on the network, so they are keyed: nothing answers without the key, the router has it.
    for replica in replicas:
        assert replica.config.api_key is not None
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            assert (await http.get(f"{replica.base_url}/v1/models")).status_code == 401


async def test_two_steps_are_held_by_both_replicas_and_rollouts_reach_both(run: Run) -> None:
    for seed in (1, 2):
        step = await train_step(run, seed)
        await check_held_everywhere(run, f"agent@{step}", run.replicas())
    assert step == 2
    assert all(chat_lines(replica.log_path) for replica in run.replicas())


async def test_a_node_lost_mid_rollout_leaves_the_router_and_the_other_serves(run: Run) -> None:
    router = run.service.router
    assert router is not None
    replicas = run.replicas()
    before = [len(chat_lines(replica.log_path)) for replica in replicas]
    rollouts = asyncio.ensure_future(sample_groups(run.model, groups=4, seed=3, max_exceptions=16))
    # The first replica rollouts reach is the victim: its node goes while they are in flight.
    while (answered := [len(chat_lines(r.log_path)) for r in replicas]) == before:
        assert not rollouts.done()
        await asyncio.sleep(0.02)
    victim, survivor = replicas if answered[0] > before[0] else replicas[::-1]
    victim_url, victim_pid = victim.base_url, victim.pid
    node = next(n for n in run.cluster.worker_nodes if n.node_id == victim.node_id)
    lost = time.monotonic()
    run.cluster.remove_node(node, allow_graceful=False)
    while victim_url in await router.workers():
        assert time.monotonic() - lost < 10, "the router still lists the lost node's replica"
        await asyncio.sleep(0.05)
    # Rollouts in flight there failed as on a server's death (kept in their groups), the others finished.
    groups = await rollouts
    assert sum(len(group.trajectories) for group in groups) > 0
    assert not psutil.pid_exists(victim_pid) or psutil.Process(victim_pid).status() == psutil.STATUS_ZOMBIE
    # What follows runs on the surviving node alone: rollouts, a step, its adapter.
    served_before = len(chat_lines(survivor.log_path))
    assert await train_step(run, seed=4) == 3
    assert len(chat_lines(survivor.log_path)) > served_before
    assert list(await router.workers()) == [survivor.base_url]
    await check_held_everywhere(run, "agent@3", [survivor])


async def test_a_node_added_back_gets_the_current_step_before_the_router_lists_it(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = run.service.router
    assert router is not None
    held_when_added: dict[str, set[str]] = {}
    add_worker = router.add_worker

    async def add_and_record(url: str, api_key: str | None = None) -> None:
        replica = next(r for r in run.replicas() if r.is_alive() and r.base_url == url)
        held_when_added[url] = set(await loaded_paths(replica))
        await add_worker(url, api_key)

    monkeypatch.setattr(router, "add_worker", add_and_record)
    node = run.cluster.add_node(**NODE)
    deadline = time.monotonic() + 180
    while len(await router.workers()) < 2:
        assert time.monotonic() < deadline, "no replica was placed on the new node"
        await asyncio.sleep(0.2)
    newcomer = next(r for r in run.replicas() if r.node_id == node.node_id)
    assert "agent@3" in held_when_added[newcomer.base_url]
    await check_held_everywhere(run, "agent@3", run.replicas())
    assert await train_step(run, seed=5) == 4
    await check_held_everywhere(run, "agent@4", run.replicas())


async def test_no_request_reached_a_replica_without_its_adapter(run: Run) -> None:
    for replica in run.replicas():
        assert check_requests_follow_loads(replica.log_path, replica.label) > 0


async def test_close_leaves_no_replica_and_the_cluster_up(run: Run) -> None:
    await run.backend.close()
    deadline = time.monotonic() + 30  # Ray reaps a killed actor's worker process on its own schedule
    while ours := replica_processes():
        assert time.monotonic() < deadline, f"left running: {ours}"
        await asyncio.sleep(0.1)
    assert not ray.is_initialized()  # the backend left the cluster it joined
    assert run.cluster.remaining_processes_alive()  # the cluster the user started stays up


async def test_with_no_replica_left_rollouts_and_train_fail_clearly(
    run: Run, tmp_path: Path, tiny_model_path: Path
) -> None:
    """A second backend, one replica, on the same cluster: once every worker node is gone, a rollout fails
    (it is not left waiting), and train() says that no replica is up."""
    config = ClusterConfig(
        address=run.cluster.address,
        gpus_per_replica=0,
        replica_resources={SLOT: 1},
        adapter_dir=str(tmp_path / "node-local"),  # a lost node keeps its folder (its log stays by design)
        placement_timeout=15,
    )
    backend = SGLangBackend(path=str(tmp_path / ".art"), engine="reference", cluster=config)
    model = art.TrainableModel(name="lonely", project="cluster", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        groups = await sample_groups(model, seed=1)
        for node in list(run.cluster.worker_nodes):
            run.cluster.remove_node(node, allow_graceful=False)
        router = backend.inference.router if backend.inference is not None else None
        assert router is not None
        deadline = time.monotonic() + 10
        while await router.workers():  # the backend noticed the loss
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        with pytest.raises(openai.APIError):
            await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        with pytest.raises((ServerCrashedError, ServerStartError), match=r"no (server replica is up|node)"):
            await backend.train(model, groups, learning_rate=1e-3)
    finally:
        await backend.close()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while ours := replica_processes():
        assert time.monotonic() < deadline, f"left running: {ours}"
        await asyncio.sleep(0.1)
