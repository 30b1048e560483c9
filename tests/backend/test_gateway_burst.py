"""Waves of concurrent multi-turn rollouts through the gateway of a real reference-engine server, adapters
hot-loaded between the waves and idle gaps longer than the server's keep-alive: no request fails.

The gateway used to keep idle connections for 30 s while the server closes them after its keep-alive (5 s),
and its pool hands out the oldest idle connection first: a request took a connection the server was closing
at that moment (502 with "Can not write request body" or `ServerDisconnectedError`; ART drops such a
rollout from its batch). Pauses between a rollout's turns close to the keep-alive (an environment's step)
make such connections all along; with the old setting this test failed 5 of its 2,000 requests. The same
test runs against real SGLang on the GPU machine (`-m gpu`, suite `burst`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from art_sglang.config import SGLangConfig, TrainerConfig
from art_sglang.planning.devices import DeviceLayout, detect_gpus
from art_sglang.planning.make_plan import make_plan
from art_sglang.planning.request import BackendRequest
from art_sglang.serving.adapters import InferenceService
from art_sglang.sglang_env import KEEP_ALIVE_ENV

KEEP_ALIVE_S = 1  # the server's: short, so the test's pauses are short too
WAVES = 5
ROLLOUTS = 100  # concurrent, per wave
TURNS = 4  # requests per rollout, with an environment's pause between them


ADAPTER_RANK = (
    4  # the trainer's too, so the test serves on any LoRA path (the triton one's pool takes one rank)
)


def _adapter(base: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    get_peft_model(model, LoraConfig(r=ADAPTER_RANK, target_modules=["q_proj", "v_proj"])).save_pretrained(
        out
    )
    return out


async def _rollout(http: httpx.AsyncClient, name: str, seed: int, outcomes: Counter[str]) -> None:
    pauses = random.Random(seed)
    for turn in range(TURNS):
        if turn:  # the environment's step: about as long as the server keeps an idle connection
            await asyncio.sleep(KEEP_ALIVE_S * pauses.uniform(0.6, 1.1))
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "logprobs": True}  # fmt: skip
        try:
            response = await http.post("/v1/chat/completions", json=body)
            outcomes[str(response.status_code)] += 1
            if response.status_code != 200:
                outcomes[response.text[:200]] += 1
        except httpx.HTTPError as exc:
            outcomes[repr(exc)] += 1


@pytest.mark.parametrize("engine", ["reference", pytest.param("sglang", marks=pytest.mark.gpu)])
async def test_bursts_with_hot_loads_between_lose_no_request(
    engine: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    adapter = _adapter(tiny_model_path, tmp_path / "adapter")
    config = SGLangConfig(server_env={KEEP_ALIVE_ENV: str(KEEP_ALIVE_S)})
    if engine == "sglang":
        # Quick to start (no CUDA graphs); PyTorch sampling, as FlashInfer's compiles at first use.
        config = config.model_copy(
            update={"disable_cuda_graph": True, "sampling_backend": "pytorch", "mem_fraction_static": 0.3}
        )
    layout = None
    if engine == "sglang":  # the server on the first visible GPU, no trainer
        cuda_ids = tuple(g.cuda_id for g in detect_gpus().gpus)
        layout = DeviceLayout("split", "sglang", (0,), (), "burst test: one GPU", cuda_ids=cuda_ids)
    plan = make_plan(
        BackendRequest(config, TrainerConfig(lora_rank=ADAPTER_RANK), engine=engine, layout=layout),
        None,
        detect_gpus(),
    )
    service = InferenceService(plan, str(tiny_model_path), log_path=tmp_path / "server.log")
    outcomes: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    try:
        await service.servers.start()
        async with httpx.AsyncClient(
            base_url=service.openai_base_url.removesuffix("/v1"),
            headers={"Authorization": f"Bearer {service.api_key}"},
            timeout=120,
            limits=limits,
            trust_env=False,
        ) as http:
            for wave in range(WAVES):
                began = time.monotonic()
                await service.add_adapter(f"agent@{wave}", adapter)  # hot-load, as a step's sync does
                await service.keep_newest("agent@", 2)
                # Idle longer than the server's keep-alive: every pooled connection is closed or closing.
                await asyncio.sleep(max(1.5 * KEEP_ALIVE_S - (time.monotonic() - began), 0))
                rollouts = (
                    _rollout(http, f"agent@{wave}", wave * ROLLOUTS + i, outcomes) for i in range(ROLLOUTS)
                )
                await asyncio.gather(*rollouts)
    finally:
        await service.close()
    total = WAVES * ROLLOUTS * TURNS
    assert total >= 2000
    assert outcomes["200"] == total, outcomes.most_common(5)
