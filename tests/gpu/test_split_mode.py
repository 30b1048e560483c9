"""Split mode on two GPUs, real SGLang: the server on GPU 0 keeps serving while the trainer works on GPU 1,
the new adapter is hot-loaded (no restart), and the prefix cache stays warm across the sync.

    pytest -m gpu tests/gpu/test_split_mode.py      (needs 2 GPUs; ~3 min)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from gpu_helpers import MemorySampler, make_groups, record, server_pids, sglang_test_config, snapshot

from art_sglang import SGLangBackend, TrainableModel

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

# ~800 tokens shared by every request of the cache check (an agent's instructions).
LONG_PREFIX = "You are an agent playing tic-tac-toe; answer with one move as row,column. " * 50


@dataclass
class Split:
    backend: SGLangBackend
    model: TrainableModel
    root: Path
    facts: dict[str, Any] = field(default_factory=dict)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(tmp_path_factory: pytest.TempPathFactory, gpu_model: str, gpu_count: int):
    if gpu_count < 2:
        pytest.skip(f"split mode needs 2 GPUs, {gpu_count} visible")
    root = tmp_path_factory.mktemp("split")
    backend = SGLangBackend(
        engine="sglang",
        inference_device=0,
        training_devices=[1],
        sglang_config=sglang_test_config(),
        path=str(root / ".art"),
    )
    model = TrainableModel(name="agent", project="gpu-split", base_model=gpu_model)
    try:
        await model.register(backend)
        yield Split(backend, model, root)
    finally:
        await backend.close()


async def _cached_tokens(client: Any, name: str) -> tuple[int, int]:
    """(cached, prompt) tokens of a request sharing LONG_PREFIX."""
    completion = await client.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": LONG_PREFIX}, {"role": "user", "content": "Your move?"}],
        max_tokens=4,
        temperature=0.0,
    )
    usage = completion.usage
    details = usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0, usage.prompt_tokens


async def test_server_and_trainer_on_their_own_gpus(split: Split) -> None:
    assert split.backend.layout.mode == "split"
    snap = snapshot()
    assert set(snap.server) == {0}, snap
    assert set(snap.trainer) <= {1}, snap
    record("split/register", server_mib=snap.server, trainer_mib=snap.trainer)


async def test_serving_continues_during_training_and_the_adapter_is_hot_loaded(split: Split) -> None:
    client = split.model.openai_client()
    await _cached_tokens(client, "agent@0")
    cache_before = await _cached_tokens(client, "agent@0")
    groups = await make_groups(client, "agent@0")
    before = snapshot()
    pids_before = server_pids()
    stop = asyncio.Event()
    outcomes: list[tuple[float, str]] = []  # (finish time, "ok" or the error)

    async def load() -> None:
        while not stop.is_set():
            try:
                await client.chat.completions.create(
                    model=split.model.get_inference_name(),
                    messages=[{"role": "user", "content": "Say something."}],
                    max_tokens=16,
                )
                outcomes.append((time.monotonic(), "ok"))
            except Exception as exc:  # every failure is counted and reported, none expected
                outcomes.append((time.monotonic(), repr(exc)))

    workers = [asyncio.create_task(load()) for _ in range(8)]
    with MemorySampler() as sampler:
        started = time.monotonic()
        result = await split.backend.train(split.model, groups, learning_rate=0.02)
        finished = time.monotonic()
    stop.set()
    await asyncio.gather(*workers)
    after = snapshot()

    assert result.step == 1 and split.model.get_inference_name() == "agent@1"
    failures = [o for _, o in outcomes if o != "ok"]
    during = [o for t, o in outcomes if started <= t <= finished]
    assert not failures, failures[:5]
    assert len(during) > 0, "no request completed while training"
    # The server never gave up its memory and was never restarted; the trainer worked on GPU 1.
    assert min(s.server.get(0, 0) for s in sampler.samples) >= 0.9 * before.server.get(0, 0)
    assert server_pids() == pids_before
    assert max(s.trainer.get(1, 0) for s in sampler.samples) > 0
    assert all(0 not in s.trainer for s in sampler.samples), "the trainer touched the inference GPU"
    listed = {m.id for m in (await client.models.list()).data}
    assert {"agent@0", "agent@1"} <= listed

    cache_old_after = await _cached_tokens(client, "agent@0")
    cache_new_first = await _cached_tokens(client, "agent@1")
    cache_new_second = await _cached_tokens(client, "agent@1")
    # No flush on sync (flush_cache_on_sync=False): the cached prefix survives the adapter load.
    assert cache_old_after[0] >= 0.9 * cache_before[0] > 0, (cache_before, cache_old_after)
    assert cache_new_second[0] > 0
    record(
        "split/train-while-serving",
        requests_total=len(outcomes),
        requests_during_training=len(during),
        failures=len(failures),
        train_seconds=finished - started,
        server_mib_gpu0_before=before.server.get(0),
        server_mib_gpu0_lowest_during=min(s.server.get(0, 0) for s in sampler.samples),
        trainer_mib_gpu1_highest_during=max(s.trainer.get(1, 0) for s in sampler.samples),
        server_mib_gpu0_after=after.server.get(0),
        cached_tokens_before_sync=cache_before,
        cached_tokens_old_adapter_after_sync=cache_old_after,
        cached_tokens_new_adapter_first=cache_new_first,
        cached_tokens_new_adapter_second=cache_new_second,
        served=sorted(listed),
        metrics={k: v for k, v in result.metrics.items() if k.startswith("time/")},
    )
