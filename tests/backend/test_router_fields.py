"""What SGLang's real router (sglang-router) forwards of a request to a replica: a recording replica
behind it shows which fields arrive. It leaves out `return_token_ids` and fields that change an answer,
which is why the gateway sends requests to the replicas itself (`serving.gateway.balancer`); if a router
release starts forwarding them, this test fails and routing through the router can be weighed again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from backend_helpers import StandIn

from art_sglang.serving.gateway.rules import CHAT_PATH
from art_sglang.serving.servers.replica_health import ReplicaRouter

pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")

pytestmark = pytest.mark.asyncio(loop_scope="module")

# What arrives: adapter selection, logprobs, grammars, biases, seeds, stops, tools.
CHAT_KEPT = {
    "lora_path": "agent@1", "logprobs": True, "top_logprobs": 2, "regex": "a+", "logit_bias": {"5": 10.0},
    "sampling_seed": 3, "seed": 3, "stop": ["x"], "stop_token_ids": [2], "ignore_eos": True,
    "no_stop_trim": True, "top_k": 5, "min_p": 0.1, "min_tokens": 1, "repetition_penalty": 1.1,
    "chat_template_kwargs": {"enable_thinking": False}, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
}  # fmt: skip
CHAT_DROPPED = {
    "stop_regex": ["</a>"], "return_prompt_token_ids": True, "cache_salt": "s", "extra_key": "k",
    "return_token_ids": True,
}  # fmt: skip
SAMPLING_KEPT = {"max_new_tokens": 4, "temperature": 1.0, "regex": "a", "stop": ["x"], "sampling_seed": 3}
SAMPLING_DROPPED = {"stop_regex": "x", "logit_bias": {"5": 10.0}, "custom_params": {"a": 1},
                    "spaces_between_special_tokens": False}  # fmt: skip


def recording_replica(bodies: dict[str, dict[str, Any]]) -> StandIn:
    """An HTTP server answering what the router asks of a replica, keeping each request body in `bodies`."""

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "is_generation": True})

    async def record(request: web.Request) -> web.Response:
        bodies[request.path] = await request.json()
        return web.json_response({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [], "text": "", "meta_info": {}})  # fmt: skip

    reads = [web.get(path, info) for path in ("/health", "/get_model_info", "/get_server_info", "/v1/models")]
    return StandIn([*reads, web.post("/{path:.*}", record)])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def routed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The router's address, and the bodies its one replica got (by path)."""
    bodies: dict[str, dict[str, Any]] = {}
    replica = recording_replica(bodies)
    router = ReplicaRouter(log_path=Path(tmp_path_factory.mktemp("router")) / "router.log")
    await replica.start()
    try:
        await router.start()
        await router.add_worker(replica.url)
        yield router.base_url, bodies
    finally:
        await router.stop()
        await replica.close()


async def _send(base_url: str, path: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        response = await http.post(f"{base_url}{path}", json=body)
    assert response.status_code == 200, response.text


async def test_a_chat_request_arrives_without_token_ids_and_regex_stops(routed) -> None:
    base_url, bodies = routed
    messages = [{"role": "user", "content": "hi"}]
    await _send(base_url, CHAT_PATH, {"model": "m", "messages": messages, **CHAT_KEPT, **CHAT_DROPPED})
    arrived = bodies[CHAT_PATH]
    assert {k: arrived.get(k) for k in CHAT_KEPT} == CHAT_KEPT
    assert sorted(k for k in CHAT_DROPPED if k in arrived) == []


async def test_generate_arrives_without_regex_stops_and_biases(routed) -> None:
    base_url, bodies = routed
    sampling = {**SAMPLING_KEPT, **SAMPLING_DROPPED}
    await _send(base_url, "/generate", {"input_ids": [1, 2], "lora_path": "agent@1", "sampling_params": sampling,
                                        "return_logprob": True, "logprob_start_len": 0})  # fmt: skip
    arrived = bodies["/generate"]
    assert (arrived["lora_path"], arrived["return_logprob"], arrived["input_ids"]) == (
        "agent@1",
        True,
        [1, 2],
    )
    assert {k: arrived["sampling_params"].get(k) for k in SAMPLING_KEPT} == SAMPLING_KEPT
    assert sorted(k for k in SAMPLING_DROPPED if k in arrived["sampling_params"]) == []


async def test_a_text_completion_arrives_whole(routed) -> None:
    base_url, bodies = routed
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 1, "lora_path": "agent@1",
            "stop_regex": ["x"], "return_token_ids": True, "logit_bias": {"5": 10.0}}  # fmt: skip
    await _send(base_url, "/v1/completions", body)
    arrived = bodies["/v1/completions"]
    assert {k: arrived.get(k) for k in body} == body
