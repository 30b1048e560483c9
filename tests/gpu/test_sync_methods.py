"""The other weight-sync methods on real SGLang: `disk` (merge the adapter into the base weights and
`update_weights_from_disk`), `restart` (restart the server with the new adapter preloaded) and `merged`
(the trainer's merged weights pushed from its memory: by CUDA IPC in shared mode on GPU 0, by NCCL
broadcast in split mode from GPU 1, to two replicas on GPUs 0 and 1 from GPU 2, and from rank 0 of a trainer
on GPUs 1 and 2; each skipped where the GPUs are missing). The mode of the others is the machine's: split
with 2 GPUs, shared (sleep) with 1. The peft trainer keeps each run short.

    pytest -m gpu tests/gpu/test_sync_methods.py      (~6 min on 1 GPU; ~12 min on 3)
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio
from gpu_helpers import PROMPTS, make_groups, record, server_pids, sglang_test_config

from art_sglang import SGLangBackend, SGLangConfig, TrainableModel, TrainerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]


# The devices of each merged layout: (GPUs needed, SGLangBackend's device arguments).
MERGED_LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "merged": (1, {"inference_device": 0, "training_devices": [0]}),
    "merged-split": (2, {"inference_device": 0, "training_devices": [1]}),
    "merged-replicas": (3, {"inference_devices": [0, 1], "training_devices": [2]}),
    "merged-ranks": (3, {"inference_device": 0, "training_devices": [1, 2]}),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["disk", "restart", *MERGED_LAYOUTS])
async def synced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gpu_model: str, gpu_count: int
):
    variant = request.param
    method = "merged" if variant in MERGED_LAYOUTS else variant
    needed, devices = MERGED_LAYOUTS.get(variant, (1, {}))
    if gpu_count < needed:
        pytest.skip(f"{variant} needs {needed} GPUs, {gpu_count} visible")
    root = tmp_path_factory.mktemp(f"sync-{variant}")
    config: SGLangConfig = sglang_test_config(weight_sync_method=method)
    backend = SGLangBackend(
        engine="sglang",
        sglang_config=config,
        trainer_config=TrainerConfig(use_unsloth=False),
        path=str(root / ".art"),
        **devices,
    )
    model = TrainableModel(name="agent", project=f"gpu-sync-{variant}", base_model=gpu_model)
    try:
        await model.register(backend)
        yield variant, backend, model
    finally:
        await backend.close()


async def _greedy(client, name: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        completion = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0.0
        )
        out.append(completion.choices[0].message.content or "")
    return out


async def test_new_step_is_served_with_the_new_weights(synced) -> None:
    variant, backend, model = synced
    method = "merged" if variant in MERGED_LAYOUTS else variant
    client = model.openai_client()
    before = await _greedy(client, "agent@0")
    pids = server_pids()
    groups = await make_groups(client, "agent@0")
    result = await backend.train(model, groups, learning_rate=0.02)
    assert result.step == 1 and model.get_inference_name() == "agent@1"
    after = await _greedy(client, "agent@1")
    assert after != before, "the new step answers exactly as step 0"
    restarted = not (server_pids() & pids)
    if method == "restart":
        assert restarted
    elif backend.layout.mode == "split" or method == "merged":
        assert not restarted  # disk sync reloads weights in place; merged pushes them
    record(
        f"sync-{variant}/{backend.layout.mode}",
        mode=backend.layout.mode,
        server_restarted=restarted,
        prompts_changed=sum(a != b for a, b in zip(before, after, strict=True)),
        metrics={k: v for k, v in result.metrics.items() if k.startswith("time/")},
    )
