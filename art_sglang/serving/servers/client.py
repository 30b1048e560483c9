"""`ServerClient`: the typed async admin API of an SGLang server (or the reference engine).

Every failure becomes a specific exception carrying the HTTP status and the server's own message: SGLang
answers refused admin requests with HTTP 400 and `success: false` plus `error_message` or `message`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from art_sglang.errors import (
    AdapterLoadError,
    AdapterNotLoadedError,
    AdapterOperationTimeoutError,
    ServerRequestError,
    ServerUnavailableError,
)
from art_sglang.serving.sglang_api import ADMIN_ROUTES


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`: the base model (parent None) or a loaded adapter (parent = base)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


def _server_message(response: httpx.Response) -> str:
    """The explanation in an error body: SGLang's `error_message`/`message`/`error`, FastAPI's `detail`, or text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, dict):
        for key in ("error_message", "message", "detail", "error"):
            if body.get(key):
                value = body[key]
                return value if isinstance(value, str) else json.dumps(value)
    return response.text.strip()


class ServerClient:
    """Admin requests to the server at `base_url` (no `/v1`): `ADMIN_ROUTES` authenticated with
    `admin_api_key` (if given, else `api_key`), the others with `api_key`, as Bearer tokens. An adapter load
    or unload gets `adapter_timeout` seconds (the client's `timeout` if None); one that does not finish in
    time is remembered in `stuck_operation`: SGLang goes on waiting with it, holding the lock of every later
    adapter operation, so the server must be restarted."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        admin_api_key: str | None = None,
        adapter_timeout: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._adapter_timeout = adapter_timeout or timeout
        self.stuck_operation: str | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin_key = admin_api_key or api_key
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        # trust_env=False: a proxy from the environment must not intercept the local server.
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, trust_env=False
        )

    @property
    def closed(self) -> bool:
        """Whether `aclose` was called (the group closes a server's client when the process is replaced)."""
        return self._http.is_closed

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        error: type[ServerRequestError] = ServerRequestError,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send a request; raise `error` on an HTTP error status, `ServerUnavailableError` if unreachable
        (or no answer within `timeout`, the client's if None)."""
        headers = self._admin_headers if path in ADMIN_ROUTES else None
        try:
            response = await self._http.request(
                method, path, json=body, headers=headers, timeout=timeout or self._http.timeout
            )
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                f"{method} {self.base_url}{path} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if response.is_error:
            self._raise(error, path, response)
        return response

    async def _adapter_command(
        self, path: str, name: str, body: dict[str, Any], error: type[ServerRequestError] = ServerRequestError
    ) -> dict[str, Any]:
        """`_post_checked` within the adapter operations' bound: `AdapterOperationTimeoutError` past it."""
        try:
            return await self._post_checked(path, body, error, timeout=self._adapter_timeout)
        except ServerUnavailableError as exc:
            if not isinstance(exc.__cause__, httpx.TimeoutException):
                raise
            self.stuck_operation = f"{path} of {name!r} did not finish within {self._adapter_timeout:g} s"
            raise AdapterOperationTimeoutError(f"{self.base_url}{self.stuck_operation}") from exc

    async def _post_checked(
        self,
        path: str,
        body: dict[str, Any],
        error: type[ServerRequestError] = ServerRequestError,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """POST an admin command whose JSON answer carries `success`; raise `error` unless it is true."""
        response = await self._request("POST", path, body, error, timeout)
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict) or data.get("success") is not True:
            self._raise(error, path, response)
        return data

    def _raise(self, error: type[ServerRequestError], path: str, response: httpx.Response) -> None:
        message = _server_message(response)
        raise error(
            f"{path} failed (HTTP {response.status_code}): {message}",
            status=response.status_code,
            server_message=message,
        )

    async def _probe(self, path: str, timeout: float | None = None) -> bool:
        try:
            response = await self._http.get(path, timeout=timeout or self._http.timeout)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def health(self, timeout: float | None = None) -> bool:
        """Whether the server process answers (`GET /health` is 200) within `timeout` seconds (the client's
        default if None); False if unreachable or too slow."""
        return await self._probe("/health", timeout)

    async def list_models(self) -> list[ModelCard]:
        """`GET /v1/models`: the base model and every loaded adapter."""
        data = (await self._request("GET", "/v1/models")).json()
        return [ModelCard.model_validate(card) for card in data["data"]]

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, str]:
        """Load the adapter at `path` as `name`; returns every loaded adapter (name -> path).

        Raises `AdapterLoadError` if refused (name already loaded, bad path, rank above the maximum, ...),
        `AdapterOperationTimeoutError` past the bound.
        """
        data = await self._adapter_command(
            "/load_lora_adapter", name, {"lora_name": name, "lora_path": path}, AdapterLoadError
        )
        return data.get("loaded_adapters") or {}

    async def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Unload adapter `name`; returns the adapters still loaded.

        Raises `AdapterNotLoadedError` (a `ServerRequestError`) if no adapter of that name is loaded.
        """
        try:
            data = await self._adapter_command("/unload_lora_adapter", name, {"lora_name": name})
        except ServerRequestError as exc:
            # SGLang: "LoRA with name X does not exist. Loaded LoRAs: ..." (HTTP 400).
            if exc.status == 400 and "does not exist" in (exc.server_message or ""):
                raise AdapterNotLoadedError(
                    str(exc), status=exc.status, server_message=exc.server_message
                ) from None
            raise
        return data.get("loaded_adapters") or {}

    async def flush_cache(self) -> None:
        """Empty the prefix cache. Raises `ServerRequestError` if the server refuses (requests running)."""
        await self._request("POST", "/flush_cache")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the server's GPU memory of the kinds in `tags` (`MEMORY_TAGS`; None = all of them) — with
        `--enable-memory-saver` only. SGLang answers 200 even without it, so success proves nothing."""
        await self._request("POST", "/release_memory_occupation", _tags_body(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back the GPU memory of the kinds in `tags` after `release_memory_occupation`."""
        await self._request("POST", "/resume_memory_occupation", _tags_body(tags))

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Replace the base weights with those at `model_path`; `ServerRequestError` if it fails."""
        await self._post_checked("/update_weights_from_disk", {"model_path": model_path})

    async def update_weights_from_tensor(
        self, payload: str, *, load_format: str | None, flush_cache: bool, weight_version: str | None
    ) -> None:
        """Load one bucket of named tensors (`named_tensors.serialize`'s base64 text, for the server's one
        tensor-parallel rank); `flush_cache` and `weight_version` belong with a push's last bucket.
        `ServerRequestError` if refused (nothing is rolled back: earlier buckets stay loaded)."""
        body = {
            "serialized_named_tensors": [payload],
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        await self._post_checked("/update_weights_from_tensor", body)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str,
    ) -> None:  # fmt: skip
        """Join the weight-update group whose rank 0 listens at `master_address:master_port` (this server's
        tensor-parallel ranks from `rank_offset`); returns once every rank joined."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        await self._post_checked("/init_weights_update_group", body)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the weight-update group `group_name`; `ServerRequestError` if the server has no such group."""
        await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self, bucket: dict[str, Any], *, group_name: str, flush_cache: bool, weight_version: str | None
    ) -> None:
        """Receive one flattened bucket broadcast by rank 0 of `group_name` (`bucket`: its tensors' `names`,
        `dtypes`, `shapes`) and load it; returns once loaded. `ServerRequestError` if it failed (the
        weights may be partly updated)."""
        body = {
            **{key: bucket[key] for key in ("names", "dtypes", "shapes")},
            "group_name": group_name,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        await self._post_checked("/update_weights_from_distributed", body)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Hold new requests in the server (`abort`: and end those in flight); see docs/merged-rollouts.md."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Let requests run again after `pause_generation`."""
        await self._request("POST", "/continue_generation", {})

    async def weight_version(self) -> str:
        """The weight version the server reports (`/model_info`): "default" until an update names one."""
        return str((await self._request("GET", "/model_info")).json()["weight_version"])

    async def metrics(self) -> str:
        """`GET /metrics` in Prometheus text format (empty unless the server runs with metrics enabled)."""
        return (await self._request("GET", "/metrics")).text


def _tags_body(tags: Sequence[str] | None) -> dict[str, Any]:
    return {} if tags is None else {"tags": list(tags)}
