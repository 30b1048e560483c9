"""Prefill sharing through the gateway, on the engine under test: rollouts with the same prompt that arrive
together are held until a prefill-only request (`max_tokens: 0`) computed it, and then find the prompt in
the engine's cache; each is answered as it was asked (its own sample on the adapter, ids with one logprob
each)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.process import ServerProcess

MESSAGES = [
    {"role": "system", "content": "You are a careful agent who plays board games well. " * 12},
    {"role": "user", "content": "Your move."},
]
K = 6


@pytest.fixture(scope="module")
def gateway(
    server: ServerProcess, client: httpx.Client, adapters: dict[str, str]
) -> Iterator[AdapterGateway]:
    loaded = client.post("/load_lora_adapter", json={"lora_name": "shared@1", "lora_path": adapters["a"]})
    assert loaded.status_code == 200, loaded.text
    # A long lead: the test's threads must find the first still waiting on a slow machine too.
    gw = AdapterGateway(server.base_url, share_lead=0.3)
    gw.start()
    gw.set_served(["shared@1"], [server.model_path])
    try:
        yield gw
    finally:
        gw.close()
        unloaded = client.post("/unload_lora_adapter", json={"lora_name": "shared@1"})
        assert unloaded.status_code == 200, unloaded.text  # no request left the adapter in use


def test_followers_find_the_prompt_computed(gateway: AdapterGateway) -> None:
    body = {"model": "shared@1", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "logprobs": True,
            "ignore_eos": True}  # fmt: skip

    def post(_: int) -> dict:
        with httpx.Client(base_url=gateway.base_url, timeout=300, trust_env=False) as http:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(K) as pool:
        answers = list(pool.map(post, range(K)))
    counters = gateway.prefill_counters()
    # Those that came after the prefill-only request returned went at once.
    assert counters["prefill_requests"] == 1 and counters["requests_held"] >= 2
    cached, samples = 0, set()
    for answer in answers:
        [choice] = answer["choices"]
        assert len(choice["token_ids"]) == 8 and len(choice["logprobs"]["content"]) == 8
        details = answer["usage"]["prompt_tokens_details"] or {}
        cached += details.get("cached_tokens", 0) >= 0.8 * answer["usage"]["prompt_tokens"]
        samples.add(tuple(choice["token_ids"]))
    assert cached == K  # every request found the prompt computed
    assert len(samples) > 1
