"""weight_sync_method="merged" over a weight-update group (docs/merged-rollouts.md; gloo on CPU, NCCL on
GPUs): in split mode and with replicas the trainer joins the servers' group as its rank 0 and broadcasts
each bucket while every server receives it (`/update_weights_from_distributed`). The group is made once and
made again only when a server or the trainer restarted, or a push failed; every step serves exactly what
peft's merged checkpoint of that step serves, on every server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_helpers import chat, kill_tree, start_when_let, wait_dead
from merged_checks import forced_logprobs
from test_merged_sync import BUCKET_BYTES, _assert_as_peft_merges, _train_step

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.errors import ServerRequestError
from art_sglang.orchestration.merge import merge
from art_sglang.planning.devices import DeviceLayout
from art_sglang.serving.adapters import InferenceService
from art_sglang.serving.gateway.resend import VERSIONS_FIELD
from art_sglang.serving.servers.client import ServerClient
from art_sglang.storage.model_store import ModelStore

# Split mode's push on CPU: the reference engine apart from the trainer, as an SGLang server on another GPU.
SPLIT_ON_CPU = DeviceLayout("split", "reference", (), (), "split mode forced on CPU for tests")
TWO_REPLICAS = DeviceLayout("cpu", "reference", (), (), "two CPU replicas for tests", replica_gpus=((), ()))


@contextlib.asynccontextmanager
async def _registered(path: Path, model_path: Path, layout: DeviceLayout) -> AsyncIterator[tuple[Any, ...]]:
    """A merged-mode backend of `layout` with model `fused` registered: (backend, model, its service)."""
    config = SGLangConfig(weight_sync_method="merged", merged_bucket_bytes=BUCKET_BYTES)
    backend = SGLangBackend(path=str(path), layout=layout, sglang_config=config)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(model_path))
    try:
        await model.register(backend)
        assert backend.inference is not None
        yield backend, model, backend.inference
    finally:
        await backend.close()


def _count_calls(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], *names: str) -> None:
    """Count the admin calls of `names` (each server's call once)."""
    for name in names:
        original = getattr(ServerClient, name)

        async def counted(
            self: ServerClient, *args: Any, _name: str = name, _call: Any = original, **kw: Any
        ) -> Any:
            calls[_name] += 1
            return await _call(self, *args, **kw)

        monkeypatch.setattr(ServerClient, name, counted)


async def test_split_mode_pushes_over_one_group_and_a_restarted_server_rejoins(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    _count_calls(monkeypatch, calls, "init_weights_update_group", "update_weights_from_distributed",
                 "update_weights_from_tensor")  # fmt: skip
    path = tmp_path / ".art"
    async with _registered(path, tiny_model_path, SPLIT_ON_CPU) as (backend, model, service):
        gateway = model.inference_base_url.removesuffix("/v1")
        served: dict[int, list[float]] = {}
        for seed in (1, 2):
            assert await _train_step(backend, model, seed) == seed
            served[seed], version = await forced_logprobs(gateway, f"fused@{seed}")
            assert version == f"fused@{seed}"
        # Made once, at register; every bucket broadcast, none sent as tensors.
        assert calls["init_weights_update_group"] == 1
        assert calls["update_weights_from_distributed"] >= 3 * 2 and not calls["update_weights_from_tensor"]
        assert served[2] != pytest.approx(served[1], abs=1e-6)

        # The server dies between steps: the restarted one joins a new group and gets the step before it
        # is routed; the next step goes over that group.
        pid = kill_tree(service.process.pid)
        await wait_dead(service.process)
        assert await service.servers.recover(probe=False)
        assert service.process.pid != pid and calls["init_weights_update_group"] == 2
        assert (await forced_logprobs(gateway, "fused@2"))[1] == "fused@2"
        assert await _train_step(backend, model, 3) == 3
        assert calls["init_weights_update_group"] == 2
        served[3], version = await forced_logprobs(gateway, "fused@3")
        assert version == "fused@3"
        assert (await chat(gateway, "fused@2")).status_code == 404
        await _assert_as_peft_merges(
            service, model.base_model, ModelStore(path, "merged", "fused"), served, tmp_path
        )


async def test_a_failed_broadcast_is_pushed_again_over_a_new_group_then_restarts_the_server(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server answers a broadcast it received with SGLang's "partially updated" refusal: the group is
    made again and the push repeated whole; when that fails too, the server restarts, joins a group of its
    own and gets the step before it is routed."""
    calls: Counter[str] = Counter()
    _count_calls(monkeypatch, calls, "init_weights_update_group")
    original = ServerClient.update_weights_from_distributed
    buckets: list[bool] = []  # each bucket received: whether it was refused
    refuse: set[int] = set()

    async def flaky(self: ServerClient, bucket: dict[str, Any], **kwargs: Any) -> None:
        await original(self, bucket, **kwargs)  # received whole: the broadcast itself went through
        buckets.append(len(buckets) in refuse)
        if buckets[-1]:
            raise ServerRequestError("Failed to update parameter online: (test). The full weights of the "
                                     "ModelRunner are partially updated.", status=400)  # fmt: skip

    monkeypatch.setattr(ServerClient, "update_weights_from_distributed", flaky)
    path = tmp_path / ".art"
    async with _registered(path, tiny_model_path, SPLIT_ON_CPU) as (backend, model, service):
        gateway = model.inference_base_url.removesuffix("/v1")
        whole = len(buckets)
        assert whole >= 2 and calls["init_weights_update_group"] == 1
        served: dict[int, list[float]] = {}

        refuse.add(whole + 1)  # step 1's second bucket, once
        assert await _train_step(backend, model, 1) == 1
        assert buckets[whole:] == [False, True] + [False] * whole
        assert calls["init_weights_update_group"] == 2
        served[1], version = await forced_logprobs(gateway, "fused@1")
        assert version == "fused@1"

        pid, start = service.process.pid, len(buckets)
        refuse.update({start + 1, start + 3})  # both attempts of step 2
        assert await _train_step(backend, model, 2) == 2
        assert buckets[start:] == [False, True, False, True] + [False] * whole
        assert service.process.pid != pid
        assert calls["init_weights_update_group"] == 4  # the second attempt's, then the restarted server's
        served[2], version = await forced_logprobs(gateway, "fused@2")
        assert version == "fused@2"
        await _assert_as_peft_merges(
            service, model.base_model, ModelStore(path, "merged", "fused"), served, tmp_path
        )


async def _replica_logprobs(service: Any) -> list[tuple[list[float], str]]:
    """Each replica's own logprobs of the forced tokens (its weights, asked directly) and its version."""
    return [await forced_logprobs(p.base_url, None, p.config.api_key) for p in service.processes]


async def test_two_replicas_in_one_group_serve_each_step_and_a_restarted_one_rejoins(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")
    calls: Counter[str] = Counter()
    _count_calls(monkeypatch, calls, "init_weights_update_group")
    path = tmp_path / ".art"
    async with _registered(path, tiny_model_path, TWO_REPLICAS) as (backend, model, service):
        assert calls["init_weights_update_group"] == 2  # one group: both replicas joined it
        assert await _train_step(backend, model, 1) == 1
        first, second = await _replica_logprobs(service)
        assert first == second and first[1] == "fused@1"
        assert calls["init_weights_update_group"] == 2

        # Replica 1 dies; step 2 reaches replica 0 alone (a group of its own); replica 1 comes back with
        # step 2 (a group of its own), and step 3 goes to both over one group again.
        victim = service.processes[1]
        started = start_when_let(monkeypatch, victim)  # after step 2: the groups are made in a known order
        killed = kill_tree(victim.pid)
        await wait_dead(victim)
        assert await _train_step(backend, model, 2) == 2
        started.set()
        deadline = time.monotonic() + 120
        while not (
            victim.is_alive() and victim.pid != killed and victim.base_url in service.servers.routed_urls()
        ):
            assert time.monotonic() < deadline, "the watchdog did not bring the replica back"
            await asyncio.sleep(0.2)
        first, second = await _replica_logprobs(service)
        assert first == second and first[1] == "fused@2"
        assert await _train_step(backend, model, 3) == 3
        first, second = await _replica_logprobs(service)
        assert first == second and first[1] == "fused@3"
        assert calls["init_weights_update_group"] == 2 + 1 + 1 + 2

        # Equal to peft's merge of step 3, loaded into replica 0.
        merged = tmp_path / "peft-merged-3"
        merge(model.base_model, ModelStore(path, "merged", "fused").checkpoint_dir(3), merged)
        await service.servers.live()[0].update_weights_from_disk(str(merged))
        expected, _ = await forced_logprobs(
            service.processes[0].base_url, None, service.processes[0].config.api_key
        )
        assert first[0] == pytest.approx(expected, abs=1e-5)


async def _versions_answering(base_url: str, name: str, asks: int = 6) -> list[Any]:
    """The status, or the weight versions of the answer, of `asks` chat completions on `name` through the
    gateway, each on another conversation (so they spread over the routed replicas)."""
    answers: list[Any] = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for n in range(asks):
            messages = [{"role": "user", "content": f"question {n}"}]
            response = await http.post(
                f"{base_url}/chat/completions", json={"model": name, "messages": messages, "max_tokens": 2}
            )
            ok = response.status_code == 200
            answers.append({v["version"] for v in response.json()["choices"][0][VERSIONS_FIELD]} if ok else
                           response.status_code)  # fmt: skip
    return answers


async def test_a_replica_restarted_before_a_steps_push_waits_unrouted_until_the_push(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 1 dies while the trainer holds step 2, not pushed yet: it comes back with the trainer's
    newest weights (step 2) but is not routed, so `fused@1` is answered by step 1's weights alone (replica
    0) and `fused@2` not at all; step 2's push reaches both, and both are routed."""
    pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")
    trained, let_push = asyncio.Event(), asyncio.Event()
    real_push = InferenceService.push_weights

    async def push_when_let(self: InferenceService, *args: Any) -> None:
        trained.set()
        await let_push.wait()
        await real_push(self, *args)

    path = tmp_path / ".art"
    async with _registered(path, tiny_model_path, TWO_REPLICAS) as (backend, model, service):
        assert await _train_step(backend, model, 1) == 1
        monkeypatch.setattr(InferenceService, "push_weights", push_when_let)
        training = asyncio.create_task(_train_step(backend, model, 2))
        await asyncio.wait_for(trained.wait(), 120)  # step 2 trained; its push waits

        survivor, victim = service.processes
        killed = kill_tree(victim.pid)
        await wait_dead(victim)
        await service.servers.recover(probe=False)  # (or the watchdog did)
        deadline = time.monotonic() + 120
        while not (victim.is_alive() and victim.pid != killed and len(service.servers.up()) == 2):
            assert time.monotonic() < deadline, "the replica did not come back"
            await asyncio.sleep(0.2)
        async with service.servers.command():  # its restart brought it up and decided its routing
            pass
        assert await _versions_answering(model.inference_base_url, "fused@2") == [404] * 6
        assert await _versions_answering(model.inference_base_url, "fused@1") == [{"fused@1"}] * 6
        assert [version for _, version in await _replica_logprobs(service)] == ["fused@1", "fused@2"]
        assert service.servers.routed_urls() == [survivor.base_url]
        assert service.router is not None and list(await service.router.workers()) == [survivor.base_url]

        let_push.set()
        assert await asyncio.wait_for(training, 120) == 2
        first, second = await _replica_logprobs(service)
        assert first == second and first[1] == "fused@2"
        assert sorted(service.servers.routed_urls()) == sorted(p.base_url for p in service.processes)
        assert sorted(await service.router.workers()) == sorted(p.base_url for p in service.processes)
        assert await _versions_answering(model.inference_base_url, "fused@2") == [{"fused@2"}] * 6
