"""Shared mode on one GPU, real SGLang, both strategies: `sleep` with the Unsloth trainer, `restart` with the
peft trainer. One backend per strategy; the tests run in order against it:

register serves step 0 -> an unknown adapter name is the base model on SGLang but a loud error through the
backend -> a training step frees the GPU (nvidia-smi, per process) and the new adapter answers after ->
the trainer's adapter changes SGLang's outputs -> SGLang's logprobs of sampled tokens agree with the
trainer's recomputation for that adapter.

    pytest -m gpu tests/gpu/test_shared_mode.py -k sleep      (~4 min on an H100; -k restart likewise)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from gpu_helpers import (
    PROMPTS,
    MemorySampler,
    generate,
    make_groups,
    output_logprobs,
    recompute,
    record,
    server_pids,
    sglang_test_config,
    snapshot,
)

from art_sglang import SGLangBackend, TrainableModel, TrainerConfig
from art_sglang.storage.model_store import ModelStore

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

RECOMPUTE = Path(__file__).parent / "recompute_logprobs.py"
# One Adam step moves every LoRA B entry by about the learning rate; 0.02 changes a random tiny model's
# outputs clearly (a real run uses ~1e-5, where the change would hide in bf16 noise).
LEARNING_RATE = 0.02
# bf16 weights, different kernels (SGLang triton attention + LoRA kernels vs. the trainer's): measured
# differences are recorded; these bounds only catch a broken path (e.g. a missing or wrong adapter).
MEAN_ABS_TOLERANCE = 0.05
MAX_ABS_TOLERANCE = 0.5


@dataclass
class Run:
    strategy: str
    backend: SGLangBackend
    model: TrainableModel
    store: ModelStore
    root: Path
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def direct_url(self) -> str:
        """SGLang itself, bypassing the backend's gateway."""
        service = self.backend.inference
        assert service is not None
        return service.process.base_url

    @property
    def direct_headers(self) -> dict[str, str]:
        """The server's own key (it differs from the key rollouts send to the gateway)."""
        service = self.backend.inference
        assert service is not None
        return {"Authorization": f"Bearer {service.process.config.api_key}"}

    @property
    def gateway_url(self) -> str:
        assert self.model.inference_base_url is not None
        return self.model.inference_base_url.removesuffix("/v1")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["sleep", "restart"])
async def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gpu_model: str):
    strategy = request.param
    root = tmp_path_factory.mktemp(f"shared-{strategy}")
    backend = SGLangBackend(
        engine="sglang",
        inference_device=0,
        training_devices=[0],
        shared_strategy=strategy,
        sglang_config=sglang_test_config(),
        trainer_config=TrainerConfig(use_unsloth="auto" if strategy == "sleep" else False),
        path=str(root / ".art"),
    )
    model = TrainableModel(name="agent", project=f"gpu-shared-{strategy}", base_model=gpu_model)
    try:
        await model.register(backend)
        yield Run(strategy, backend, model, ModelStore(str(root / ".art"), model.project, model.name), root)
    finally:
        await backend.close()


async def _greedy(client: Any, name: str, prompt: str) -> str:
    completion = await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0.0
    )
    return completion.choices[0].message.content or ""


async def test_register_serves_step_zero(run: Run) -> None:
    assert run.backend.layout.mode == "shared"
    assert run.model.get_inference_name() == "agent@0"
    listed = {m.id for m in (await run.model.openai_client().models.list()).data}
    assert "agent@0" in listed
    snap = snapshot()
    assert snap.server_alive and snap.server_mib() > 1000, snap
    run.facts["server_mib_serving"] = snap.server_mib()
    record(f"shared-{run.strategy}/register", served=sorted(listed), server_mib=snap.server_mib(),
           trainer_mib=snap.trainer_mib(), gpu_total_mib=snap.total)  # fmt: skip


async def test_unknown_adapter_is_base_on_sglang_but_an_error_through_the_backend(run: Run) -> None:
    body = {"model": "agent@7", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        direct = await http.post(
            f"{run.direct_url}/v1/chat/completions", json=body, headers=run.direct_headers
        )
        via_backend = await http.post(f"{run.gateway_url}/v1/chat/completions", json=body)
    # SGLang's trap: HTTP 200, the unknown name echoed, the base model answering.
    assert direct.status_code == 200, direct.text
    assert direct.json()["model"] == "agent@7"
    assert via_backend.status_code == 404, via_backend.text
    assert "agent@7" in via_backend.text and "not loaded" in via_backend.text
    with pytest.raises(openai.NotFoundError):
        await _greedy(run.model.openai_client(), "agent@7", PROMPTS[0])
    record(f"shared-{run.strategy}/unknown-adapter", direct_status=direct.status_code,
           direct_model=direct.json()["model"], backend_status=via_backend.status_code,
           backend_error=via_backend.json()["error"]["message"])  # fmt: skip


async def test_training_step_hands_the_gpu_to_the_trainer(run: Run) -> None:
    client = run.model.openai_client()
    run.facts["greedy_step0"] = [await _greedy(client, "agent@0", p) for p in PROMPTS]
    groups = await make_groups(client, "agent@0")
    before = snapshot()
    server_pids_before = server_pids()
    with MemorySampler() as sampler:
        result = await run.backend.train(run.model, groups, learning_rate=LEARNING_RATE)
    after = snapshot()
    assert result.step == 1 and run.model.get_inference_name() == "agent@1"
    during = sampler.samples
    lowest_server = min(s.server_mib() for s in during)
    if run.strategy == "sleep":
        # Same server process throughout, its memory released during the step and restored after.
        assert all(s.server_alive for s in during)
        assert lowest_server < 0.2 * before.server_mib(), [s.server_mib() for s in during]
        assert server_pids() & server_pids_before
    else:
        assert any(not s.server_alive for s in during), "the server was never stopped during the step"
        assert not (server_pids() & server_pids_before), "the same server process still runs"
    assert after.server_mib() >= 0.9 * before.server_mib(), (before, after)
    assert await _greedy(client, "agent@1", PROMPTS[0]) is not None  # the new adapter answers
    state = json.loads((run.store.checkpoints_dir / "0001" / "trainer_state.json").read_text())
    run.facts["trainer_backend"] = state["backend"]
    record(
        f"shared-{run.strategy}/train-step",
        trainer_backend=state["backend"],
        server_mib_before=before.server_mib(),
        server_mib_lowest_during=lowest_server,
        server_absent_samples=sum(not s.server_alive for s in during),
        samples=len(during),
        trainer_mib_highest_during=max(s.trainer_mib() for s in during),
        server_mib_after=after.server_mib(),
        gpu_total_mib_before=before.total,
        gpu_total_mib_lowest_during={g: min(s.total[g] for s in during) for g in before.total},
        gpu_total_mib_after=after.total,
        metrics={k: v for k, v in result.metrics.items() if k.startswith(("time/", "loss", "tokenize/"))},
    )


async def test_trained_adapter_changes_sglang_outputs(run: Run) -> None:
    client = run.model.openai_client()
    step0 = run.facts["greedy_step0"]
    step1 = [await _greedy(client, "agent@1", p) for p in PROMPTS]
    assert step0 != step1, "the step-1 adapter gives the same greedy outputs as step 0"
    # Step 0's adapter has B = 0: SGLang must answer exactly as the base model does. And SGLang's second
    # trap: a bare adapter name as `model`, even a loaded one, is the base model (only "<base>:<name>" or
    # `lora_path` select an adapter), so the gateway must add `lora_path`.
    base_id = run.model.base_model
    base, bare = [], []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for prompt in PROMPTS:
            for name, out in ((base_id, base), ("agent@1", bare)):
                body = {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                        "temperature": 0.0}  # fmt: skip
                response = await http.post(
                    f"{run.direct_url}/v1/chat/completions", json=body, headers=run.direct_headers
                )
                out.append(response.json()["choices"][0]["message"]["content"])
    assert base == step0
    record(f"shared-{run.strategy}/adapter-changes-outputs",
           prompts_changed=sum(a != b for a, b in zip(step0, step1, strict=True)), prompts=len(PROMPTS),
           direct_bare_name_is_base=bare == base)  # fmt: skip
    assert bare == base


async def test_sglang_logprobs_agree_with_the_trainer(run: Run) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model.base_model)
    samples = []
    for i, prompt in enumerate(PROMPTS * 2):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
        result = await generate(run.gateway_url, ids, lora="agent@1", max_new_tokens=32, seed=i)
        out_ids, logprobs = output_logprobs(result)
        samples.append({"input_ids": ids + out_ids, "prompt_len": len(ids), "sampler_logprobs": logprobs})
    report = recompute(RECOMPUTE, run.store.checkpoints_dir / "0001", run.root / "recompute", samples)
    record(f"shared-{run.strategy}/logprob-agreement", **report)
    assert report["trainer_backend"] == run.facts["trainer_backend"]
    agree, base = report["trainer_vs_sglang"], report["trainer_without_adapter_vs_sglang"]
    assert agree["mean_abs"] < MEAN_ABS_TOLERANCE and agree["max_abs"] < MAX_ABS_TOLERANCE, report
    # The adapter moved the model much further than the two engines differ: SGLang applied it.
    assert base["mean_abs"] > 3 * agree["mean_abs"], report
