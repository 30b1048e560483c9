"""Checks of merged mode (docs/merged-rollouts.md) whose bodies run on both engines: on CPU against the
reference engine (tests/backend/test_merged_against_lora.py, a few steps, float32) and on a GPU against
SGLang (tests/gpu/test_merged_against_lora_on_gpu.py, 50 steps, bf16). The caller builds the backend for
its engine and says how a step is trained, how close two servers must agree and where the numbers each
check measures go.

A server "holding a version whole" is the engine launched directly, as the backend launched it but with
LoRA on, holding that step's checkpoint folder as an adapter: what `weight_sync_method="lora"` serves.
Both sides are compared on teacher-forced logprobs of fixed token ids (`/generate` with `input_ids`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from backend_helpers import bearer, chat, kill_tree

import art_sglang as art
from art_sglang import SGLangBackend
from art_sglang.process_tree import collect_tree
from art_sglang.serving.servers.client import ServerClient
from art_sglang.serving.servers.process import ServerProcess

# Fixed prompt-and-completion ids the logprobs are teacher-forced on: the same tokens whatever the
# weights, every id below 2,048 (the CPU tiny model's vocabulary; the GPU one has 4,096).
PROBE = [300 + 35 * i for i in range(48)]
# Step N's weights must differ from the version they are told apart from by this many tolerances at least,
# or a match within the tolerance would prove nothing.
SEPARATION = 4.0


async def forced_logprobs(
    base_url: str, name: str | None, key: str | None = None, tokens: list[int] = PROBE
) -> tuple[list[float], str]:
    """The logprob of each of `tokens` after the ones before it, and the version that answered: served as
    the adapter or served name `name` (SGLang's `lora_path`), or by the server's own weights (None)."""
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if name is not None:
        body["lora_path"] = name
    async with httpx.AsyncClient(timeout=120, trust_env=False, headers=bearer(key)) as http:
        response = await http.post(f"{base_url}/generate", json=body)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    return [float(entry[0]) for entry in meta["input_token_logprobs"][1:]], meta["weight_version"]


def max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@dataclass(frozen=True)
class Training:
    """How one engine's test trains and compares: rollouts of the model's current step, the learning rate
    (large enough that the weights move), the largest absolute logprob difference two servers holding
    the same weights may show (float32 on CPU: rounding only; bf16 on a GPU: serving noise), and where
    the measured numbers go (the GPU's results file)."""

    groups: Callable[[art.TrainableModel], Awaitable[list[art.TrajectoryGroup]]]
    learning_rate: float
    tolerance: float
    report: Callable[[dict[str, Any]], None] = lambda numbers: None  # given the numbers before the asserts


async def train_step(backend: SGLangBackend, model: art.TrainableModel, how: Training) -> Any:
    """One RL step on rollouts of the model's current step; its result."""
    groups = await how.groups(model)
    return await backend.train(
        model, groups, learning_rate=how.learning_rate, allow_training_without_logprobs=True
    )


def _gateway(model: art.TrainableModel) -> str:
    assert model.inference_base_url is not None
    return model.inference_base_url.removesuffix("/v1")


def _server(backend: SGLangBackend) -> Any:
    service = backend.inference
    assert service is not None
    return service.process


@contextlib.asynccontextmanager
async def lora_server(like: Any, adapter: str, log_path: Path) -> AsyncIterator[str]:
    """A server launched as the backend launched `like` (its engine, GPUs and flags) but with LoRA on and
    no keys, holding the checkpoint folder `adapter` under the name "held"; yields its URL."""
    config = like.config.model_copy(update={"weight_sync_method": "lora", "api_key": None, "port": None})
    process = ServerProcess(
        config, like.model_path, engine=like.engine, log_path=log_path, gpu_ids=like.gpu_ids
    )
    await process.start()
    try:
        async with ServerClient(process.base_url) as client:
            await client.load_lora_adapter("held", adapter)
        yield process.base_url
    finally:
        await process.stop()


async def merged_against_lora(
    backend: SGLangBackend, model: art.TrainableModel, how: Training, steps: int, log_dir: Path
) -> None:
    """Register `model` on `backend` (merged mode), train `steps` steps, read the served step's logprobs
    through the gateway, close the backend, and compare with the engine holding the last step's adapter
    under LoRA: equal within the tolerance, and far from the base model's."""
    try:
        await model.register(backend)
        for _ in range(steps):
            result = await train_step(backend, model, how)
        name = model.get_inference_name()
        assert result.step == steps and name == f"{model.name}@{steps}"
        merged, version = await forced_logprobs(_gateway(model), name)
        assert version == name
        like = _server(backend)
    finally:
        await backend.close()
    async with lora_server(like, result.checkpoint_path, log_dir / "lora-server.log") as url:
        lora, _ = await forced_logprobs(url, "held")
        base, _ = await forced_logprobs(url, None)
    numbers = {
        "steps": steps,
        "merged_vs_lora_max_abs": max_abs(merged, lora),
        "merged_vs_lora_mean_abs": mean_abs(merged, lora),
        "lora_vs_base_max_abs": max_abs(lora, base),
        "lora_vs_base_mean_abs": mean_abs(lora, base),
        "tolerance": how.tolerance,
    }
    how.report(numbers)
    assert numbers["merged_vs_lora_max_abs"] <= how.tolerance, numbers
    assert numbers["lora_vs_base_max_abs"] >= SEPARATION * how.tolerance, numbers  # the weights moved


async def crash_mid_push(
    backend: SGLangBackend, model: art.TrainableModel, how: Training, log_dir: Path, monkeypatch: Any
) -> None:
    """Register (step 0's merged weights pushed whole), then the server SIGKILLed (whole tree) once the
    first bucket of step 1's push has loaded, so it would hold a mix of both steps. train() must return
    step 1 (the failed push is pushed again, then the server restarted and pushed whole before it is
    routed: docs/merged-rollouts.md section 5, "failures"), and the served name must answer with one
    version's whole weights: those of the engine holding step 1's adapter under LoRA, far from step 0's."""
    original = ServerClient.update_weights_from_tensor
    loaded: list[bool] = []  # per bucket a server loaded: whether it came after the kill
    armed: list[bool] = []  # set once step 0 is served
    killed: dict[str, Any] = {}

    async def killing(self: ServerClient, payload: str, **kwargs: Any) -> None:
        await original(self, payload, **kwargs)
        loaded.append(bool(killed))
        if armed and not killed:  # step 1's first bucket is in: the server would hold a mix
            pid = _server(backend).pid
            killed["tree"] = [p.pid for p in collect_tree(pid)]
            killed["pid"] = kill_tree(pid)
            killed["last"] = kwargs["weight_version"] is not None

    monkeypatch.setattr(ServerClient, "update_weights_from_tensor", killing)
    name = f"{model.name}@1"
    try:
        await model.register(backend)
        whole = len(loaded)  # the push at register: the buckets of a whole push
        assert whole >= 2, f"a push of {whole} bucket(s) cannot be cut between buckets: lower the bucket size"
        before, _ = await forced_logprobs(_gateway(model), f"{model.name}@0")
        armed.append(True)
        result = await train_step(backend, model, how)
        assert killed and not killed["last"], "step 1's push was not cut between buckets"
        assert result.step == 1 and model.get_inference_name() == name
        assert _server(backend).pid != killed["pid"]  # restarted
        alive = [pid for pid in killed["tree"] if _running(pid)]
        assert not alive, f"processes of the killed server still run: {alive}"
        after, version = await forced_logprobs(_gateway(model), name)
        assert version == name
        assert (await chat(_gateway(model), f"{model.name}@0")).status_code == 404
        like = _server(backend)
    finally:
        await backend.close()
    async with lora_server(like, result.checkpoint_path, log_dir / "lora-server.log") as url:
        held, _ = await forced_logprobs(url, "held")
    numbers = {
        "buckets_per_push": whole,
        "buckets_after_restart": sum(loaded),
        "served_vs_step1_max_abs": max_abs(after, held),
        "served_vs_step1_mean_abs": mean_abs(after, held),
        "step0_vs_step1_max_abs": max_abs(before, held),
        "tolerance": how.tolerance,
    }
    how.report(numbers)
    assert numbers["buckets_after_restart"] >= whole, numbers  # the restarted server got a whole push
    assert numbers["served_vs_step1_max_abs"] <= how.tolerance, numbers
    assert numbers["step0_vs_step1_max_abs"] >= SEPARATION * how.tolerance, numbers


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
