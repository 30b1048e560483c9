"""weight_sync_method="merged" on CPU (docs/merged-rollouts.md): the server runs without LoRA; after each
step the trainer pushes its adapter merged into its own base weights (`/update_weights_from_tensor`, in
buckets, generation paused) and `<name>@<step>` is served by the base slot once the server reports that
version. Each step must serve exactly what peft's merged checkpoint of that step serves
(`weight_sync_method="disk"`'s merge), an older step's name is refused, and a failed push is recovered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
from backend_helpers import chat, kill_tree, sample_groups, settled
from merged_checks import forced_logprobs

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.errors import ServerUnavailableError
from art_sglang.orchestration.merge import merge
from art_sglang.serving.servers.client import ServerClient
from art_sglang.storage.model_store import ModelStore

# The tiny model's wrapped weights take a few hundred KiB: this cuts a push into several buckets.
BUCKET_BYTES = 64 << 10


async def _train_step(backend: SGLangBackend, model: art.TrainableModel, seed: int) -> int:
    groups = await sample_groups(model, seed=seed)
    result = await backend.train(model, groups, learning_rate=5e-2, allow_training_without_logprobs=True)
    return result.step


def _backend(path: Path) -> SGLangBackend:
    config = SGLangConfig(weight_sync_method="merged", merged_bucket_bytes=BUCKET_BYTES)
    return SGLangBackend(path=str(path), sglang_config=config)


async def _assert_as_peft_merges(
    service: Any, base_model: str, store: ModelStore, served: dict[int, list[float]], tmp_path: Path
) -> None:
    """Each step's logprobs as served equal those of peft's merged checkpoint of that step, loaded from
    disk into the same server."""
    process = service.process
    [client] = service.servers.live()  # the admin client
    for step, logprobs in served.items():
        merged = tmp_path / f"peft-merged-{step}"
        merge(base_model, store.checkpoint_dir(step), merged)
        await client.update_weights_from_disk(str(merged))
        expected, _ = await forced_logprobs(process.base_url, None, process.config.api_key)
        assert logprobs == pytest.approx(expected, abs=1e-5), step


async def test_three_merged_steps_serve_what_peft_merges(tmp_path: Path, tiny_model_path: Path) -> None:
    path = tmp_path / ".art"
    backend = _backend(path)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    children: list[psutil.Process] = []
    try:
        await model.register(backend)
        service = backend.inference
        assert service is not None
        assert "--enable-lora" not in service.process.command()
        assert not [arg for arg in service.process.command() if "lora" in arg]
        gateway = model.inference_base_url.removesuffix("/v1")
        base, version = await forced_logprobs(gateway, "fused@0")
        assert version == "fused@0"
        served: dict[int, list[float]] = {}
        for seed in (1, 2, 3):
            step = await _train_step(backend, model, seed)
            assert step == seed and model.get_inference_name() == f"fused@{step}"
            served[step], version = await forced_logprobs(gateway, f"fused@{step}")
            assert version == f"fused@{step}"
            assert served[step] != pytest.approx(base, abs=1e-6)  # the step changed the policy
            old = await chat(gateway, f"fused@{step - 1}")
            assert old.status_code == 404
            assert f"the merged weights hold `fused@{step}`" in old.json()["error"]["message"]
        assert (await chat(gateway, "fused@3")).status_code == 200
        children = psutil.Process().children(recursive=True)
        assert children  # the trainer and the server
        store = ModelStore(path, "merged", "fused")
        await _assert_as_peft_merges(service, model.base_model, store, served, tmp_path)
    finally:
        await backend.close()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


async def test_a_failed_push_is_pushed_again_then_restarts_the_server(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push cut short after its first bucket leaves the server holding a mix: it is pushed whole again;
    when every attempt fails, the server restarts and gets the whole step before it is routed."""
    path = tmp_path / ".art"
    backend = _backend(path)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    original = ServerClient.update_weights_from_tensor
    buckets: list[bool] = []  # each bucket posted: whether it was refused
    refuse: set[int] = set()  # the buckets (by number) to refuse

    async def flaky(self: ServerClient, payload: str, **kwargs: Any) -> None:
        buckets.append(len(buckets) in refuse)
        if buckets[-1]:
            raise ServerUnavailableError("the connection was reset (test)")
        await original(self, payload, **kwargs)

    monkeypatch.setattr(ServerClient, "update_weights_from_tensor", flaky)
    try:
        await model.register(backend)
        service = backend.inference
        assert service is not None
        gateway = model.inference_base_url.removesuffix("/v1")
        store = ModelStore(path, "merged", "fused")
        served: dict[int, list[float]] = {}

        whole = len(buckets)  # the push at register: the buckets of a whole push
        assert whole >= 2 and not any(buckets)

        # Step 1: the second bucket fails once; the whole push is tried again.
        refuse.add(whole + 1)
        assert await _train_step(backend, model, 1) == 1
        assert buckets[whole:] == [False, True] + [False] * whole
        served[1], version = await forced_logprobs(gateway, "fused@1")
        assert version == "fused@1"

        # Step 2: both attempts fail; the server restarts and is given step 2 before it is routed.
        pid = service.process.pid
        start = len(buckets)
        refuse.update({start + 1, start + 3})
        assert await _train_step(backend, model, 2) == 2
        assert buckets[start:] == [False, True, False, True] + [False] * whole
        assert service.process.pid != pid
        served[2], version = await forced_logprobs(gateway, "fused@2")
        assert version == "fused@2"
        assert (await chat(gateway, "fused@1")).status_code == 404
        await _assert_as_peft_merges(service, model.base_model, store, served, tmp_path)
    finally:
        await backend.close()


async def test_a_trainer_that_dies_mid_push_is_restarted_and_pushes_the_step_whole(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer killed while the server holds the first bucket of step 1 (a mix): it restarts from its
    newest complete checkpoint, step 1, and pushes that whole before `fused@1` is served."""
    path = tmp_path / ".art"
    backend = _backend(path)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    store = ModelStore(path, "merged", "fused")
    original = ServerClient.update_weights_from_tensor
    killed: list[int] = []
    armed: list[bool] = []  # once registered

    async def killing(self: ServerClient, payload: str, **kwargs: Any) -> None:
        await original(self, payload, **kwargs)
        if armed and not killed:  # step 1's first bucket, once
            settled(store.checkpoint_dir(1).parent)  # step 1 resumable
            killed.append(kill_tree(backend.trainer(model).pid))

    monkeypatch.setattr(ServerClient, "update_weights_from_tensor", killing)
    try:
        await model.register(backend)
        armed.append(True)
        service = backend.inference
        assert service is not None
        assert await _train_step(backend, model, 1) == 1
        assert killed and backend.trainer(model).pid not in killed
        served, version = await forced_logprobs(model.inference_base_url.removesuffix("/v1"), "fused@1")
        assert version == "fused@1"
        await _assert_as_peft_merges(service, model.base_model, store, {1: served}, tmp_path)
    finally:
        await backend.close()
