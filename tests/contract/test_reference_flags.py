"""The reference engine with other launch flags: --api-key, metrics off, --served-model-name, --lora-paths,
--disable-radix-cache, --context-length, --lora-target-modules, --max-loaded-loras, memory saver without CPU
backup, unknown flags, the request log.
Reference engine only (SGLang's own flags are its business)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from contract_helpers import MESSAGES, contract_config, make_adapter, running_server

from art_sglang.serving.servers.process import ServerProcess

KEY = "sekret"


@pytest.fixture(scope="module")
def flagged_server(
    engine: str, model_path: str, adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    if engine != "reference":
        pytest.skip("flags of the reference engine")
    config = contract_config(
        "reference",
        api_key=KEY,
        enable_metrics=False,
        enable_weights_cpu_backup=False,
        disable_radix_cache=True,
        context_length=256,
        # Fused names, as SGLang spells them, cover q/k/v and gate/up.
        lora_target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        extra_args=[
            "--lora-paths",
            f"boot={adapters['a']}",
            "--served-model-name",
            "tiny",
            "--max-loaded-loras",
            "2",
            "--no-such-flag",
            "7",
        ],
    )
    log = tmp_path_factory.mktemp("flagged") / "server.log"
    with running_server(config, model_path, "reference", log) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(flagged_server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(
        base_url=flagged_server.base_url, headers=headers, timeout=60.0, trust_env=False
    ) as client:
        yield client


def _greedy(http: httpx.Client, model: str = "default") -> str:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_api_key_guards_all_but_health(flagged_server: ServerProcess, http: httpx.Client) -> None:
    with httpx.Client(base_url=flagged_server.base_url, trust_env=False) as anonymous:
        refused = anonymous.get("/v1/models")
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        assert anonymous.post("/load_lora_adapter", json={}).status_code == 401
        assert anonymous.get("/health").status_code == 200
        # Without --enable-metrics there is no /metrics route at all (SGLang mounts it only then).
        assert anonymous.get("/metrics").status_code == 404
    assert http.get("/v1/models").status_code == 200


def test_served_name_and_adapters_from_the_command_line(
    http: httpx.Client, model_path: str, adapters: dict[str, str]
) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert cards[0]["id"] == "tiny" and cards[0]["max_model_len"] == 256
    assert cards[1] == {**cards[1], "id": "boot", "root": adapters["a"], "parent": "tiny"}
    assert http.get("/get_model_info").json()["model_path"] == model_path
    assert _greedy(http, "tiny:boot") != _greedy(http)


def test_radix_cache_disabled_reports_no_cached_tokens(http: httpx.Client) -> None:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2}
    for _ in range(2):
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"] is None


def test_context_length_limits_requests(http: httpx.Client) -> None:
    too_long = {"model": "default", "messages": MESSAGES, "max_tokens": 300}
    answer = http.post("/v1/chat/completions", json=too_long)
    assert answer.status_code == 400 and "maximum context length of 256" in answer.json()["message"]
    prompt = {"model": "default", "messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 1}
    answer = http.post("/v1/chat/completions", json=prompt)
    assert answer.status_code == 400 and "longer than the model's context length" in answer.json()["message"]
    assert _greedy(http)


def test_release_without_cpu_backup_rereads_weights(http: httpx.Client) -> None:
    before = _greedy(http)
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    info = http.get("/get_server_info").json()["internal_states"][0]
    assert info["memory_released"] is True
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    assert _greedy(http) == before
    assert _greedy(http, "tiny:boot") != before  # adapters survive a release


def test_log_has_one_line_per_request_and_names_ignored_flags(
    flagged_server: ServerProcess, http: httpx.Client
) -> None:
    http.get("/get_model_info")
    _greedy(http, "tiny:boot")
    log = Path(flagged_server.log_path).read_text()
    assert "ignoring flags the reference engine does not know: --no-such-flag 7" in log
    assert "ignoring GPU-only flags" in log
    assert "GET /get_model_info 200" in log
    chat_lines = [line for line in log.splitlines() if "POST /v1/chat/completions 200" in line]
    assert chat_lines and "adapter=boot" in chat_lines[-1] and "completion=8" in chat_lines[-1]


def test_adapter_limits_from_the_command_line(
    http: httpx.Client, model_path: str, adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    head = make_adapter(
        model_path, tmp_path_factory.mktemp("head") / "lora", rank=4, targets=["lm_head"], seed=4
    )
    refused = http.post("/load_lora_adapter", json={"lora_name": "head", "lora_path": str(head)})
    assert refused.status_code == 400 and "--lora-target-modules" in refused.json()["error_message"]

    assert (
        http.post("/load_lora_adapter", json={"lora_name": "second", "lora_path": adapters["b"]}).status_code
        == 200
    )
    try:
        third = http.post("/load_lora_adapter", json={"lora_name": "third", "lora_path": adapters["b"]})
        assert third.status_code == 400 and "--max-loaded-loras" in third.json()["error_message"]
    finally:
        http.post("/unload_lora_adapter", json={"lora_name": "second"})
