"""The gateway's routing rule without sockets: which requests are forwarded, on which path, with which
body, and what every other request is answered."""

from __future__ import annotations

import json

import pytest

from art_sglang.serving.gateway.rules import Forward, Refuse, Served, normalize_path, route

SERVED = Served(frozenset({"agent@1"}), frozenset({"base"}), {"merged@3": "base"})


def _chat(model: str, **extra: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/chat/completions/", "/v1/chat/completions"),
        ("/v1/chat/%63ompletions", "/v1/chat/completions"),
        ("//V1/Chat/./x/../completions?x=1", "/v1/chat/completions"),
        ("/%2e%2e/v1/models", "/v1/models"),
    ],
)
def test_paths_are_normalized_before_anything_is_decided(target: str, path: str) -> None:
    assert normalize_path(target)[0] == path


@pytest.mark.parametrize(
    "target",
    ["/v1/chat/completions/", "/v1/chat/%63ompletions", "/V1/CHAT/COMPLETIONS", "/v1//chat/completions"],
)
def test_a_disguised_inference_path_still_checks_the_model(target: str) -> None:
    refused = route("POST", target, _chat("agent@0"), SERVED)
    assert isinstance(refused, Refuse) and refused.status == 404 and refused.unknown == ("agent@0",)
    forwarded = route("POST", target, _chat("agent@1"), SERVED)
    assert isinstance(forwarded, Forward) and forwarded.path == "/v1/chat/completions"


def test_another_step_of_merged_weights_is_refused_naming_the_step_they_hold() -> None:
    for name in ("merged@2", "merged@4"):
        refused = route("POST", "/v1/chat/completions", _chat(name), SERVED)
        assert isinstance(refused, Refuse) and refused.status == 404 and refused.unknown == (name,)
        assert (
            f"`{name}` is not served: the merged weights hold `merged@3`"
            in refused.payload["error"]["message"]
        )
    other = route("POST", "/v1/chat/completions", _chat("agent@0"), SERVED)
    assert isinstance(other, Refuse) and "Loaded adapters: agent@1" in other.payload["error"]["message"]


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("POST", "/load_lora_adapter"),
        ("POST", "/unload_lora_adapter"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/release_memory_occupation"),
        ("GET", "/server_info"),
        ("GET", "/get_server_info"),
        ("POST", "/flush_cache"),
        ("GET", "/metrics"),
        ("POST", "/%6coad_lora_adapter"),
    ],
)
def test_admin_and_unknown_routes_are_404(method: str, target: str) -> None:
    refused = route(method, target, b"{}", SERVED)
    assert (
        isinstance(refused, Refuse)
        and refused.status == 404
        and refused.payload["error"]["code"] == "not_found"
    )


def test_read_routes_pass_and_keep_their_query() -> None:
    for target in ("/v1/models", "/health", "/health_generate/", "/v1/models?x=1"):
        assert isinstance(route("GET", target, b"", SERVED), Forward)
    assert route("GET", "/v1/models?x=1", b"", SERVED).path == "/v1/models?x=1"  # type: ignore[union-attr]
    assert route("GET", "/v1/chat/completions", b"", SERVED).status == 405  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"9" * 5000 + b"}"],
)
def test_bodies_that_are_not_a_json_object_are_400(body: bytes) -> None:
    refused = route("POST", "/v1/chat/completions", body, SERVED)
    assert isinstance(refused, Refuse) and refused.status == 400


def test_routing_rewrites() -> None:
    adapter = route("POST", "/v1/chat/completions", _chat("agent@1"), SERVED)
    assert isinstance(adapter, Forward)
    sent = json.loads(adapter.body)
    assert (
        sent["lora_path"] == "agent@1" and sent["return_token_ids"] is True and adapter.names == ("agent@1",)
    )
    alias = json.loads(route("POST", "/v1/completions", _chat("merged@3"), SERVED).body)  # type: ignore[union-attr]
    assert alias["model"] == "base" and "lora_path" not in alias
    streamed = json.loads(route("POST", "/v1/chat/completions", _chat("agent@1", stream=True), SERVED).body)  # type: ignore[union-attr]
    assert "return_token_ids" not in streamed
    declined = json.loads(
        route("POST", "/v1/chat/completions", _chat("agent@1", return_token_ids=False), SERVED).body
    )  # type: ignore[union-attr]
    assert declined["return_token_ids"] is False
    base = route("POST", "/v1/chat/completions", _chat("base"), SERVED)
    assert isinstance(base, Forward) and base.body == _chat("base")  # unchanged
    batch = {"text": ["a", "b"], "lora_path": ["agent@1", "merged@3"]}
    sent = json.loads(route("POST", "/generate", json.dumps(batch).encode(), SERVED).body)  # type: ignore[union-attr]
    assert sent["lora_path"] == ["agent@1", None]
    assert isinstance(route("POST", "/v1/chat/completions", _chat("base:agent@1"), SERVED), Forward)
    assert isinstance(route("POST", "/v1/chat/completions", _chat("other:agent@1"), SERVED), Refuse)


def test_a_caller_without_the_key_is_not_told_the_served_names() -> None:
    refused = route("POST", "/v1/chat/completions", _chat("agent@0"), SERVED, authorized=False)
    assert (
        isinstance(refused, Refuse) and refused.status == 401 and "agent@1" not in json.dumps(refused.payload)
    )


@pytest.mark.parametrize(
    ("target", "fields"),
    [
        ("/v1/chat/completions", {"n": 2}),
        ("/v1/chat/completions", {"n": 2.0}),
        ("/v1/chat/completions", {"n": "2"}),
        ("/v1/completions", {"n": "2", "prompt": "hi"}),
        ("/generate", {"sampling_params": {"n": 2}}),
        ("/generate", {"sampling_params": [{"n": 2}, {"n": 2}], "text": ["a", "b"]}),
    ],
)
def test_n_over_one_on_an_adapter_is_refused_in_every_spelling(target: str, fields: dict) -> None:
    body = json.loads(_chat("agent@1", **fields))
    refused = route("POST", target, json.dumps(body).encode(), SERVED)
    assert isinstance(refused, Refuse) and refused.status == 400
    assert refused.payload["error"]["code"] == "n_with_adapter"
    assert isinstance(route("POST", target, json.dumps({**body, "model": "base"}).encode(), SERVED), Forward)


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 2.5},
        {"n": None},
        {"n": "two"},
        {"sampling_params": "n=2"},
        # /generate takes its n raw: SGLang fails these with a TypeError (its OpenAI routes coerce them).
        {"sampling_params": {"n": "2"}},
        {"sampling_params": {"n": 2.0}},
        {"sampling_params": [{"n": 2}, {"n": 2.0}], "text": ["a", "b"]},
    ],
)
def test_an_n_the_server_would_refuse_is_400(fields: dict) -> None:
    target = "/generate" if "sampling_params" in fields else "/v1/chat/completions"
    refused = route("POST", target, _chat("base", **fields), SERVED)
    assert isinstance(refused, Refuse) and refused.status == 400
    assert refused.payload["error"]["code"] == "invalid_n"
    assert isinstance(route("POST", "/v1/chat/completions", _chat("agent@1", n=1.0), SERVED), Forward)
