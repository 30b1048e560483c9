"""The other weight-sync methods on real SGLang: `disk` (merge the adapter into the base weights and
`update_weights_from_disk`), `restart` (restart the server with the new adapter preloaded) and `merged`
(the trainer's merged weights pushed from its memory by CUDA IPC; shared mode on GPU 0 whatever the machine,
the only layout it is built for). The mode of the others is the machine's: split with 2 GPUs, shared (sleep)
with 1. The peft trainer keeps each run short.

    pytest -m gpu tests/gpu/test_sync_methods.py      (~6 min)
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from gpu_helpers import PROMPTS, make_groups, record, server_pids, sglang_test_config

from art_sglang import SGLangBackend, SGLangConfig, TrainableModel, TrainerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["disk", "restart", "merged"])
async def synced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    method = request.param
    root = tmp_path_factory.mktemp(f"sync-{method}")
    config: SGLangConfig = sglang_test_config(weight_sync_method=method)
    backend = SGLangBackend(
        engine="sglang",
        sglang_config=config,
        trainer_config=TrainerConfig(use_unsloth=False),
        path=str(root / ".art"),
        **({"inference_device": 0, "training_devices": [0]} if method == "merged" else {}),
    )
    model = TrainableModel(name="agent", project=f"gpu-sync-{method}", base_model=gpu_model)
    try:
        await model.register(backend)
        yield method, backend, model
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
    method, backend, model = synced
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
        f"sync-{method}/{backend.layout.mode}",
        mode=backend.layout.mode,
        server_restarted=restarted,
        prompts_changed=sum(a != b for a, b in zip(before, after, strict=True)),
        metrics={k: v for k, v in result.metrics.items() if k.startswith("time/")},
    )
