"""SGLang 0.5.17 counts a request against its adapter before it checks the request's length, and gives
the count back only when a request finishes generating: after a request it refused for its length, an
unload of that adapter never answers, and every later adapter load waits behind it. The backend's guard
(serving/gateway/stranded_adapters.py) rests on this, so both engines are held to it: an ordinary request leaves the
adapter free to unload, a length-refused one does not.

A request with `n > 1` gives one count back more than it took, with the same end; the gateway refuses
it on an adapter, reading `n` with serving/choice_count.py. Both engines are held to that reading: every
spelling of `n` the server answers has as many choices per prompt as the reading says, and every one it
does not serve (a 4xx; on SGLang's /generate, a dropped connection) the reading refuses."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from contract_helpers import contract_config, running_server

from art_sglang.serving.choice_count import ChoiceCountError, choices_per_prompt
from art_sglang.serving.gateway.stranded_adapters import strands_adapter

# (route, the request's fields): `n` spelled every way a client may send it.
SPELLINGS = [
    ("/v1/chat/completions", {"n": 2}),
    ("/v1/chat/completions", {"n": 2.0}),
    ("/v1/chat/completions", {"n": "2"}),
    ("/v1/chat/completions", {"n": 1.0}),
    ("/v1/chat/completions", {"n": 2.5}),
    ("/v1/completions", {"n": "2"}),
    ("/generate", {"sampling_params": {"n": 2, "max_new_tokens": 2}}),
    ("/generate", {"sampling_params": {"n": 2.0, "max_new_tokens": 2}}),
    ("/generate", {"sampling_params": {"n": "2", "max_new_tokens": 2}}),
    ("/generate", {"sampling_params": [{"n": 2, "max_new_tokens": 2}]}),
]


def _chat(http: httpx.Client, adapter: str | None, max_tokens: int) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    if adapter is not None:
        body["lora_path"] = adapter
    return http.post("/v1/chat/completions", json=body)


def test_a_length_refused_request_keeps_its_adapter_from_unloading(
    engine: str, model_path: str, adapters: dict[str, str], tmp_path: Path
) -> None:
    with (
        running_server(contract_config(engine), model_path, engine, tmp_path / "server.log") as proc,
        httpx.Client(base_url=proc.base_url, timeout=120.0, trust_env=False) as http,
    ):
        for name in ("free", "stuck"):
            assert http.post(
                "/load_lora_adapter", json={"lora_name": name, "lora_path": adapters["a"]}
            ).json()["success"]
        assert _chat(http, "free", 2).status_code == 200
        assert http.post("/unload_lora_adapter", json={"lora_name": "free"}).json()["success"]

        refused = _chat(http, "stuck", 10**7)  # prompt + max_tokens over any context
        assert refused.status_code == 400
        assert strands_adapter(refused.status_code, refused.content), refused.text
        with pytest.raises(httpx.ReadTimeout):
            http.post("/unload_lora_adapter", json={"lora_name": "stuck"}, timeout=5.0)
        # The unload that never ends holds the lock of every adapter load.
        with pytest.raises(httpx.ReadTimeout):
            http.post(
                "/load_lora_adapter", json={"lora_name": "later", "lora_path": adapters["b"]}, timeout=5.0
            )
        assert _chat(http, None, 2).status_code == 200  # generation itself goes on


def _spelled(path: str, fields: dict, adapter: str | None) -> dict:
    """A one-prompt request to `path` with `fields` (a list of sampling_params: a batch of one prompt)."""
    lora = {"lora_path": adapter} if adapter is not None else {}
    if path == "/generate":
        batch = isinstance(fields["sampling_params"], list)
        return {"text": ["hi"] if batch else "hi", **fields, **lora}
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    return {"model": "default", "max_tokens": 2, **prompt, **fields, **lora}


def _choices(path: str, response: httpx.Response) -> int:
    body = response.json()
    if path == "/generate":
        return len(body) if isinstance(body, list) else 1
    return len(body["choices"])


def test_every_spelling_of_n_is_read_as_the_server_reads_it(
    engine: str, model_path: str, adapters: dict[str, str], tmp_path: Path
) -> None:
    with (
        running_server(contract_config(engine), model_path, engine, tmp_path / "server.log") as proc,
        httpx.Client(base_url=proc.base_url, timeout=120.0, trust_env=False) as http,
    ):
        answers = []
        for path, fields in SPELLINGS:
            body = _spelled(path, fields, None)
            try:
                read: int | str = choices_per_prompt(path, body)
            except ChoiceCountError:
                read = "refused"
            try:
                response: httpx.Response | None = http.post(path, json=body)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # SGLang 0.5.17's /generate fails a non-integer n with a TypeError and drops the connection.
                response = None
            status = "connection dropped" if response is None else f"HTTP {response.status_code}"
            answers.append(f"{path} {fields}: {status}, read as {read}")
            if response is not None and response.status_code == 200:
                assert _choices(path, response) == read, answers[-1]
            else:  # the server did not serve it: the reading refuses it too
                assert read == "refused", answers[-1]
                assert response is None or 400 <= response.status_code < 600, answers[-1]
        print("\n".join(answers))  # what the server made of each spelling (-s shows it)

        # n > 1 on an adapter strands it, in any spelling; n=1.0 does not.
        for name in ("one", "two"):
            assert http.post(
                "/load_lora_adapter", json={"lora_name": name, "lora_path": adapters["a"]}
            ).json()["success"]
        assert http.post("/v1/chat/completions", json=_spelled(*SPELLINGS[3], "one")).status_code == 200
        assert http.post("/unload_lora_adapter", json={"lora_name": "one"}).json()["success"]
        assert http.post("/v1/chat/completions", json=_spelled(*SPELLINGS[2], "two")).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            http.post("/unload_lora_adapter", json={"lora_name": "two"}, timeout=5.0)
