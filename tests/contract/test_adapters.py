"""LoRA adapters at run time: they change the output, are chosen per request with `model="<base>:<name>"`
or `lora_path` (several loaded at once, concurrent requests included), an unloaded adapter that a request
names is loaded again from its path (SGLang 0.5.17 keeps every name it loaded), load/unload errors are 400
with a message and the server keeps serving; and SGLang's trap: a bare model name is served by the base
model with HTTP 200, even the name of a loaded adapter (the recorded SGLang 0.5.17 answers show it)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
from contract_helpers import MESSAGES, chat, greedy

from art_sglang.serving.servers.process import ServerProcess


def _load(client: httpx.Client, name: str, path: str) -> httpx.Response:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _unload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/unload_lora_adapter", json={"lora_name": name})


def _served(client: httpx.Client) -> list[str]:
    """The ids `/v1/models` lists: the base model first, then the loaded adapters."""
    return [card["id"] for card in client.get("/v1/models").json()["data"]]


@pytest.fixture(scope="module")
def base_answer(client: httpx.Client) -> str:
    return greedy(client)


def test_adapter_changes_output_and_unload_restores_base(
    client: httpx.Client, adapters: dict[str, str], model_path: str, base_answer: str
) -> None:
    loaded = _load(client, "agent@1", adapters["a"])
    assert loaded.status_code == 200, loaded.text
    try:
        assert loaded.json()["success"] is True
        assert loaded.json()["loaded_adapters"]["agent@1"] == adapters["a"]

        with_adapter = greedy(client, f"{model_path}:agent@1")
        assert with_adapter != base_answer
        assert greedy(client, lora_path="agent@1") == with_adapter
        # The trap: the adapter's bare name does not select it; the base model answers, name echoed.
        bare = chat(client, "agent@1", max_tokens=12, ignore_eos=True)
        assert bare.status_code == 200 and bare.json()["model"] == "agent@1"
        assert bare.json()["choices"][0]["message"]["content"] == base_answer

        unloaded = _unload(client, "agent@1")
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json() == {
            "rid": None,
            "http_worker_ipc": None,
            "success": True,
            "error_message": "",
            "loaded_adapters": {},
        }
        assert _served(client) == [model_path]
        # Its bare name is still served by the base model.
        response = chat(client, "agent@1", max_tokens=12, ignore_eos=True)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "agent@1"
        assert response.json()["choices"][0]["message"]["content"] == base_answer
        # SGLang remembers every adapter it loaded: naming the unloaded one loads it again from its path.
        assert greedy(client, f"{model_path}:agent@1") == with_adapter
        assert _served(client) == [model_path, "agent@1"]
        assert _unload(client, "agent@1").status_code == 200
        native = client.post("/generate", json={"text": "hi", "lora_path": "agent@1"})
        assert native.status_code == 200, native.text
        assert _served(client) == [model_path, "agent@1"]
    finally:
        _unload(client, "agent@1")


def test_a_never_loaded_adapter_is_refused(client: httpx.Client, model_path: str) -> None:
    refused = chat(client, f"{model_path}:never@1")
    assert refused.status_code == 400, refused.text
    assert "never been loaded: never@1" in refused.json()["message"]
    native = client.post("/generate", json={"text": "hi", "lora_path": "never@1"})
    assert native.status_code == 400, native.text
    assert "never been loaded: never@1" in native.text


def test_an_unloaded_adapter_whose_files_are_gone_is_refused(
    client: httpx.Client, adapters: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    copy = tmp_path / "gone"
    shutil.copytree(adapters["a"], copy)
    assert _load(client, "gone@1", str(copy)).status_code == 200
    assert _unload(client, "gone@1").status_code == 200
    shutil.rmtree(copy)
    refused = chat(client, f"{model_path}:gone@1")
    assert refused.status_code == 400, refused.text
    assert "Failed to implicitly load LoRA adapter gone@1" in refused.json()["message"]
    assert _served(client) == [model_path]


def test_unknown_model_name_is_served_by_base_model(client: httpx.Client, base_answer: str) -> None:
    response = chat(client, "nope@7", max_tokens=12, ignore_eos=True)
    assert response.status_code == 200
    assert response.json()["model"] == "nope@7"
    assert response.json()["choices"][0]["message"]["content"] == base_answer


def test_two_adapters_chosen_per_request(
    client: httpx.Client, adapters: dict[str, str], model_path: str, base_answer: str
) -> None:
    for name, key in (("m@1", "a"), ("m@2", "b")):
        assert _load(client, name, adapters[key]).status_code == 200
    try:
        answers = {name: greedy(client, f"{model_path}:{name}") for name in ("m@1", "m@2")}
        assert len({base_answer, *answers.values()}) == 3, answers
        # /generate selects the adapter with lora_path.
        body = {
            "text": "hello",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        native = {
            name: client.post("/generate", json={**body, "lora_path": name}).json()["output_ids"]
            for name in ("m@1", "m@2", None)
        }
        assert native["m@1"] != native[None] and native["m@2"] != native[None]

        cards = client.get("/v1/models").json()["data"]
        assert cards[0]["id"] == model_path and cards[0]["parent"] is None
        by_id = {card["id"]: card for card in cards[1:]}
        assert by_id["m@1"]["root"] == adapters["a"] and by_id["m@1"]["parent"] == model_path
        assert by_id["m@2"]["root"] == adapters["b"] and by_id["m@2"]["parent"] == model_path
    finally:
        for name in ("m@1", "m@2"):
            _unload(client, name)


def test_load_and_unload_errors_keep_the_server_serving(
    client: httpx.Client, adapters: dict[str, str], model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert _load(client, "e@1", adapters["a"]).status_code == 200
    try:
        missing = tmp_path_factory.mktemp("nothing") / "does_not_exist"
        refusals = {
            "already loaded": _load(client, "e@1", adapters["a"]),
            "bad path": _load(client, "e@9", str(missing)),
            "rank": _load(client, "e@32", adapters["rank32"]),
        }
        for what, response in refusals.items():
            assert response.status_code == 400, (what, response.text)
            body = response.json()
            assert body["success"] is False and body["error_message"], what
            assert body["loaded_adapters"] == {"e@1": adapters["a"]}, what
        assert "already loaded" in refusals["already loaded"].json()["error_message"]
        assert "rank 32" in refusals["rank"].json()["error_message"]

        unknown = _unload(client, "zzz")
        assert unknown.status_code == 400
        assert unknown.json()["success"] is False and "zzz" in unknown.json()["error_message"]
        assert unknown.json()["loaded_adapters"] is None

        assert chat(client, f"{model_path}:e@1").status_code == 200
        assert _served(client) == [model_path, "e@1"]
    finally:
        _unload(client, "e@1")


async def test_concurrent_requests_match_sequential_answers(
    server: ServerProcess, client: httpx.Client, adapters: dict[str, str], model_path: str
) -> None:
    for name, key in (("c@1", "a"), ("c@2", "b")):
        assert _load(client, name, adapters[key]).status_code == 200
    try:
        jobs = [(f"{model_path}:c@{1 + i % 2}", f"question number {i}") for i in range(8)]

        def body(model: str, text: str) -> dict:
            messages = [*MESSAGES[:-1], {"role": "user", "content": text}]
            return {
                "model": model,
                "messages": messages,
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
            }

        sequential = [
            client.post("/v1/chat/completions", json=body(m, t)).json()["choices"][0]["message"]["content"]
            for m, t in jobs
        ]
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, trust_env=False) as http:
            answers = await asyncio.gather(
                *(http.post("/v1/chat/completions", json=body(m, t)) for m, t in jobs)
            )
        assert all(a.status_code == 200 for a in answers)
        assert [a.json()["choices"][0]["message"]["content"] for a in answers] == sequential
        assert [a.json()["model"] for a in answers] == [m for m, _ in jobs]
    finally:
        for name in ("c@1", "c@2"):
            _unload(client, name)


async def test_health_answers_while_generating(server: ServerProcess, engine: str) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, trust_env=False) as http:
        long = {
            "model": "default",
            "messages": MESSAGES,
            "max_tokens": 1500,
            "ignore_eos": True,
            "temperature": 0,
        }
        generation = asyncio.create_task(http.post("/v1/chat/completions", json=long))
        await asyncio.sleep(0.3)
        health = await http.get("/health")
        assert health.status_code == 200
        if engine == "reference":
            # 1500 tokens take seconds on CPU; the event loop answered in the meantime.
            assert not generation.done()
        assert (await generation).status_code == 200


def test_release_of_the_kv_cache_only_keeps_weights_and_adapters(
    client: httpx.Client, adapters: dict[str, str], engine: str, base_answer: str
) -> None:
    """Shared mode's cheap handoff: `tags=["kv_cache"]` frees the KV cache; base weights and loaded
    adapters stay, so nothing needs reloading after the resume."""
    assert _load(client, "kv@1", adapters["a"]).status_code == 200
    try:
        with_adapter = greedy(client, lora_path="kv@1")
        released = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert released.status_code == 200 and released.json() is None
        if engine == "reference":
            assert chat(client).status_code == 503
            metrics = client.get("/metrics").text.splitlines()
            weights = next(line for line in metrics if line.startswith("sglang:weight_memory_usage_gb"))
            assert float(weights.rsplit(" ", 1)[1]) > 0.0
        resumed = client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        assert resumed.status_code == 200 and resumed.json() is None
        assert greedy(client) == base_answer
        assert greedy(client, lora_path="kv@1") == with_adapter
        assert "kv@1" in _served(client)
    finally:
        _unload(client, "kv@1")
