"""SGLang 0.5.17 counts a request against its adapter before it checks the request's length, and gives
the count back only when a request finishes generating: after a request it refused for its length, an
unload of that adapter never answers, and every later adapter load waits behind it. The backend's guard
(serving/gateway/stranded_adapters.py) rests on this, so both engines are held to it: an ordinary request leaves the
adapter free to unload, a length-refused one does not."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from contract_helpers import contract_config, running_server

from art_sglang.serving.gateway.stranded_adapters import strands_adapter


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
