"""Replay the 39 request/response pairs recorded from real SGLang 0.5.17 (golden/, made by
shared/device/capture_golden.py) in their order, and compare status codes, content types and JSON shapes.
Texts are not compared: they depend on the model's weights."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from contract_helpers import load_golden, parse_sse, shape_mismatches

CASES = [c for c in load_golden() if c is not None]
# What the recorded requests named on the capture machine, and what stands for it here.
RECORDED_PATHS = (
    "/root/tiny",
    "/root/lora_a",
    "/root/lora_rank32",
    "/root/does_not_exist",
    "/root/nothing_here",
)
# /get_server_info dumps all of SGLang's ~400 flags; these are the ones a client of this project reads.
SERVER_INFO_KEYS = {
    "model_path", "tokenizer_path", "served_model_name", "host", "port", "tp_size", "enable_lora",
    "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "context_length", "disable_radix_cache",
    "enable_cache_report", "enable_metrics", "enable_memory_saver", "enable_weights_cpu_backup", "api_key",
    "version", "weight_version", "internal_states", "status", "max_req_input_len", "max_total_num_tokens",
}  # fmt: skip


def _substitute(value: Any, paths: dict[str, str]) -> Any:
    if isinstance(value, str):
        return paths.get(value, value)
    if isinstance(value, dict):
        return {k: _substitute(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, paths) for v in value]
    return value


@pytest.fixture(scope="module")
def replayed(
    client: httpx.Client, model_path: str, adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, httpx.Response]:
    """Every golden request sent in the recorded order (later cases depend on earlier ones)."""
    missing = tmp_path_factory.mktemp("missing")
    here = [
        model_path,
        adapters["a"],
        adapters["rank32"],
        str(missing / "does_not_exist"),
        str(missing / "x"),
    ]
    paths = dict(zip(RECORDED_PATHS, here, strict=True))
    answers = {}
    for case in CASES:
        request = case["request"]
        if isinstance(request, str):  # the malformed-JSON case keeps its raw bytes
            kwargs: dict[str, Any] = {
                "content": request.encode(),
                "headers": {"content-type": "application/json"},
            }
        elif request is None:
            kwargs = {}
        else:
            kwargs = {"json": _substitute(request, paths)}
        answers[case["name"]] = client.request(case["method"], case["path"], **kwargs)
    return answers


def _media_type(content_type: str | None) -> str | None:
    return content_type.split(";")[0].strip() if content_type else None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_sglang(case: dict[str, Any], replayed: dict[str, httpx.Response]) -> None:
    answer = replayed[case["name"]]
    assert answer.status_code == case["status"], answer.text[:500]
    assert _media_type(answer.headers.get("content-type")) == _media_type(case["content_type"])
    golden = case["response"]
    if _media_type(case["content_type"]) == "text/event-stream":
        ours, theirs = parse_sse(answer.text), parse_sse(golden)
        assert ours[-1] == theirs[-1] == "[DONE]"
        # First chunk (role), a content chunk, the finish chunk and the usage chunk keep their shapes.
        for index in (0, 1, -3, -2):
            assert not shape_mismatches(ours[index], theirs[index]), (index, ours[index])
        return
    if case["path"] == "/get_server_info":
        missing = SERVER_INFO_KEYS - set(answer.json())
        assert not SERVER_INFO_KEYS - set(golden) and not missing, missing
        return
    if case["path"] == "/metrics":
        assert "# TYPE sglang:" in answer.text
        return
    if isinstance(golden, str):
        assert answer.text == golden or (golden == "" and answer.text == "")
        return
    assert not shape_mismatches(answer.json(), golden)


# SHA-256 of ../shared/device/sglang-0.5.17-golden.json, the recording made on SGLang 0.5.17.
RECORDED_SHA256 = "e56052963fa0d564bb603e0cc73aaf269ddf3f33f6936ffad12318c77853e468"


def test_golden_file_is_the_recorded_one() -> None:
    """The copy in tests/contract/golden/ (for a fresh clone) is byte for byte the recording, and so is
    ../shared/device's original where it sits next to the repository."""
    copy = Path(__file__).parent / "golden" / "sglang-0.5.17-golden.json"
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == RECORDED_SHA256
    shared = Path(__file__).resolve().parents[2] / "../shared/device/sglang-0.5.17-golden.json"
    if shared.exists():
        assert hashlib.sha256(shared.read_bytes()).hexdigest() == RECORDED_SHA256


def test_bare_adapter_name_is_served_by_the_base_model(replayed: dict[str, httpx.Response]) -> None:
    """What the recording shows: after loading `m@1`, `model="m@1"` got the base model's greedy answer
    (identical logprobs), while /generate with `lora_path="m@1"` got a different one."""

    def content(name: str) -> str:
        return replayed[name].json()["choices"][0]["message"]["content"]

    assert content("chat with adapter") == content("chat basic")
    assert (
        replayed["generate with adapter"].json()["output_ids"]
        != replayed["generate text"].json()["output_ids"]
    )
