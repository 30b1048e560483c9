"""Request merging through the gateway, on the engine under test: of identical rollouts sent together, the
first goes on its own and the others become one `n` request, and each caller's answer is one the trainer can use — its own sample on the adapter, its
sampled ids with one logprob each, logprobs that are the model's own for those ids, usage of its own, and
the prompt found cached by the merged choices."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from art_sglang.server.gateway import AdapterGateway
from art_sglang.server.process import ServerProcess

MESSAGES = [
    {"role": "system", "content": "You are a careful agent who plays board games well. " * 12},
    {"role": "user", "content": "Your move."},
]
K = 6


@pytest.fixture(scope="module")
def gateway(
    server: ServerProcess, client: httpx.Client, adapters: dict[str, str]
) -> Iterator[AdapterGateway]:
    loaded = client.post("/load_lora_adapter", json={"lora_name": "merge@1", "lora_path": adapters["a"]})
    assert loaded.status_code == 200, loaded.text
    # A wide window: the test's threads must meet in it on a slow machine too.
    gw = AdapterGateway(server.base_url, merge_window=0.3)
    gw.start()
    gw.set_served(["merge@1"], [server.model_path])
    try:
        yield gw
    finally:
        gw.close()
        client.post("/unload_lora_adapter", json={"lora_name": "merge@1"})


def _together(url: str, body: dict, k: int = K) -> list[dict]:
    def post(_: int) -> dict:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as http:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(k) as pool:
        return list(pool.map(post, range(k)))


def _rollout(model: str, **extra: object) -> dict:
    return {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": True,
        **extra,
    }


def test_merged_rollouts_on_an_adapter_are_separate_samples(gateway: AdapterGateway) -> None:
    before = gateway.merge_counters()["requests_merged"]
    answers = _together(gateway.base_url, _rollout("merge@1", ignore_eos=True))
    assert gateway.merge_counters()["requests_merged"] - before == K - 1
    samples, cached = set(), 0
    for answer in answers:
        [choice] = answer["choices"]
        ids = choice["token_ids"]
        assert choice["index"] == 0 and len(ids) == 8 and len(choice["logprobs"]["content"]) == 8
        assert answer["usage"]["completion_tokens"] == 8
        details = answer["usage"]["prompt_tokens_details"] or {}
        cached += details.get("cached_tokens", 0) >= 0.8 * answer["usage"]["prompt_tokens"]
        samples.add(tuple(ids))
    # The merged choices found the prompt computed (by the prefill-only copy SGLang sends first, if the
    # first request had not computed it yet).
    assert cached >= K - 1
    assert len(samples) > 1
    assert len({answer["id"] for answer in answers}) == K


def test_merged_logprobs_are_the_models_own(gateway: AdapterGateway, model_path: str, engine: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    answers = _together(
        gateway.base_url, _rollout(_base_id(gateway), return_token_ids=True, return_prompt_token_ids=True)
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tolerance = 1e-3 if engine == "reference" else 5e-2  # SGLang computes in bfloat16
    for answer in answers:
        [choice] = answer["choices"]
        prompt, sampled = choice["prompt_token_ids"], choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sampled])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        expected = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(sampled)]
        reported = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert reported == pytest.approx(expected, abs=tolerance)


def _base_id(gateway: AdapterGateway) -> str:
    [base] = sorted(gateway.served - {"merge@1"})
    return base
