"""Helpers for the backend tests: real reference-engine servers and real trainer workers on CPU."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # environments/ is a top-level folder of the checkout

import art_sglang as art  # noqa: E402
from art_sglang.serving.servers.process import claim_port, release_port  # noqa: E402
from art_sglang.storage.checkpoints import is_complete, step_folders  # noqa: E402
from environments.char_share import CharShareTask  # noqa: E402

TASK = CharShareTask(max_tokens=6)


async def sample_groups(
    model: Any, *, groups: int = 2, size: int = 4, seed: int = 0, max_exceptions: int = 0
) -> list[art.TrajectoryGroup]:
    """Rollouts of the character-share task on the model's current step, through model.openai_client(),
    each Choice with its logprobs and sampled token ids (up to `max_exceptions` failed rollouts kept)."""
    return await art.gather_trajectory_groups(
        (
            art.TrajectoryGroup(
                TASK.rollout(model, TASK.prompts[g], seed * 1000 + g * 10 + i) for i in range(size)
            )
            for g in range(groups)
        ),
        pbar_desc=None,
        max_exceptions=max_exceptions,
    )


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header for `key` (none for None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


async def server_models(base_url: str, key: str | None = None) -> set[str]:
    """Ids listed by GET /v1/models of a server (or the gateway), `base_url` without /v1; `key`: the
    server's own key (a backend's server is closed without it: `service.process.config.api_key`)."""
    async with httpx.AsyncClient(timeout=30, trust_env=False, headers=bearer(key)) as http:
        response = await http.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return {card["id"] for card in response.json()["data"]}


async def chat(
    base_url: str, model: str, *, max_tokens: int = 4, stream: bool = False, key: str | None = None
) -> httpx.Response:
    """One chat completion straight over HTTP (no client-side checks), `base_url` without /v1 (`key` as
    for `server_models`)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    async with httpx.AsyncClient(timeout=120, trust_env=False, headers=bearer(key)) as http:
        response = await http.post(f"{base_url}/v1/chat/completions", json=body)
        await response.aread()
        return response


def settled(checkpoints: Path, timeout_s: float = 30.0) -> None:
    """Wait until every step folder under `checkpoints` is complete: a step's optimizer.pt follows its
    answer by a moment (training/checkpoint_writer.py)."""
    deadline = time.monotonic() + timeout_s
    while not all(is_complete(p) for p in step_folders(checkpoints)) and time.monotonic() < deadline:
        time.sleep(0.05)


def tree_snapshot(root: Path) -> dict[str, int]:
    """Every file under `root` (its checkpoints complete) with its size: compared before and after to
    prove nothing changed."""
    settled(root)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


async def served_by_each(service: Any, name: str, processes: Any = None) -> list[str]:
    """For each replica (or each of `processes`): 'yes' when its GET /v1/models lists `name` and a request
    selecting the adapter (SGLang's `lora_path`) answers 200, else 'no (<status>)'."""
    answers = []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        for process in service.processes if processes is None else processes:
            body = {"model": service.base_model, "lora_path": name, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            key = bearer(process.config.api_key)  # the replica's own key, where it has one
            reply = await http.post(f"{process.base_url}/v1/chat/completions", json=body, headers=key)
            models = await http.get(f"{process.base_url}/v1/models", headers=key)
            listed = {card["id"] for card in models.json()["data"]}
            answers.append(
                "yes" if name in listed and reply.status_code == 200 else f"no ({reply.status_code})"
            )
    return answers


def start_when_let(monkeypatch: Any, process: Any) -> asyncio.Event:
    """Make the next starts of a server `process` wait until the returned event is set (an SGLang start
    takes minutes: what a test does meanwhile must not wait for it)."""
    let = asyncio.Event()
    real_start = process.start

    async def start() -> None:
        await let.wait()
        await real_start()

    monkeypatch.setattr(process, "start", start)
    return let


async def wait_dead(process: Any, timeout_s: float = 10.0) -> None:
    """Wait until a killed server process is gone."""
    deadline = time.monotonic() + timeout_s
    while process.is_alive():
        assert time.monotonic() < deadline, f"{process.label} still runs"
        await asyncio.sleep(0.05)


def kill_tree(pid: int | None, sig: signal.Signals = signal.SIGKILL) -> int:
    """Send `sig` to a process and every process under it (SIGKILL: a crash, not a stop; SIGSTOP: a hang);
    returns its pid."""
    assert pid is not None
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        proc.send_signal(sig)
    return pid


@contextlib.asynccontextmanager
async def server_with_adapter(model: Path, folder: Path) -> AsyncIterator[Any]:
    """A reference-engine server on `model` (log in `folder`) with a random adapter loaded as `agent@1`."""
    from art_sglang import SGLangConfig
    from art_sglang.serving.servers.client import ServerClient
    from art_sglang.serving.servers.process import ServerProcess

    adapter = random_adapter(model, folder / "adapter")
    process = ServerProcess(SGLangConfig(), str(model), engine="reference", log_path=folder / "server.log")
    await process.start()
    try:
        async with ServerClient(process.base_url) as client:
            await client.load_lora_adapter("agent@1", str(adapter))
        yield process
    finally:
        await process.stop()


def random_adapter(base: Path, out: Path) -> Path:
    """A LoRA adapter with random (non-zero) B, so it visibly changes the model's output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(
        r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out


REQUEST = re.compile(r"(POST|GET) (/\S+) (\d{3}) \S+ ?(.*)")


def chat_lines(log: Path) -> list[str]:
    """The chat completions a reference-engine server answered, from its log."""
    return [line for line in log.read_text().splitlines() if "POST /v1/chat/completions" in line]


def check_requests_follow_loads(log: Path, label: str) -> int:
    """Read a reference-engine server's log in order: every chat request on an adapter came after that
    server (in its current process) loaded it and before it unloaded it, and was answered 200. Returns
    how many chat requests it served."""
    loaded: set[str] = set()
    served = 0
    for line in log.read_text().splitlines():
        if line.startswith("starting "):
            loaded = set()  # a new process holds nothing
        match = REQUEST.search(line)
        if match is None:
            continue
        _, route, status, fields = match.groups()
        values = dict(f.split("=", 1) for f in fields.split() if "=" in f)
        if route == "/load_lora_adapter" and status == "200":
            loaded.add(values["lora"])
        elif route == "/unload_lora_adapter" and status == "200":
            loaded.discard(values["lora"])
        elif route == "/v1/chat/completions":
            served += 1
            assert status == "200", line
            adapter = values.get("adapter", "base")
            assert adapter == "base" or adapter in loaded, f"{label}: {line}"
    return served


@contextlib.contextmanager
def simulated_ray_cluster(node: dict[str, Any], **head: Any) -> Iterator[Any]:
    """A Ray head (no CPUs for replicas; `head` adds to its settings) and two worker nodes of `node`'s
    resources in this box, shut down after. Ray's own health checks notice a lost node within a second
    or two here (its defaults take ~15 s)."""
    from ray.cluster_utils import Cluster

    fast_health = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": fast_health, **head},
    )
    try:
        for _ in range(2):
            cluster.add_node(**node)
        yield cluster
    finally:
        cluster.shutdown()


def cpu_replicas_on(cluster: Any, slot: str, root: Path) -> art.ClusterConfig:
    """Two CPU replicas on `cluster`'s worker nodes (each offers one `slot`), adapters under `root`."""
    return art.ClusterConfig(
        address=cluster.address,
        inference_replicas=2,
        gpus_per_replica=0,
        replica_resources={slot: 1},
        adapter_dir=str(root / "node-local"),
        placement_timeout=300,
    )


class StandIn:
    """An HTTP server on a free loopback port answering `routes` (aiohttp route definitions): a stand-in
    for a replica or the router where a test needs to see or steer what they answer."""

    def __init__(self, routes: list[web.RouteDef]) -> None:
        self.port = claim_port("127.0.0.1", None)
        self._routes = routes
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(self._routes)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        """Stop answering: the port then refuses connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        await self.stop()
        release_port(self.port)


# `n > 1` spelled every way a client may send it: (route, the request's fields besides model and prompt,
# the gateway's error code). /generate takes its `n` raw and SGLang fails a non-integer one: refused as such.
N_SPELLINGS = [
    ("/v1/chat/completions", {"n": 2}, "n_with_adapter"),
    ("/v1/chat/completions", {"n": 2.0}, "n_with_adapter"),
    ("/v1/chat/completions", {"n": "2"}, "n_with_adapter"),
    ("/v1/completions", {"n": "2", "prompt": "hi"}, "n_with_adapter"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 2}}, "n_with_adapter"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, "n_with_adapter"),
    ("/generate", {"text": "hi", "sampling_params": {"n": "2", "max_new_tokens": 2}}, "invalid_n"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2.0, "max_new_tokens": 2}}, "invalid_n"),
]


async def assert_n_refused(gateway: str, adapter: str) -> None:
    """Every spelling of `n > 1` on `adapter` is answered 400 by the gateway at `gateway` (without /v1)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=120, trust_env=False) as http:
        for path, fields, code in N_SPELLINGS:
            body = {
                "model": adapter,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                **fields,
            }
            if path == "/generate":
                body = {"lora_path": adapter, **fields}
            refused = await http.post(path, json=body)
            assert refused.status_code == 400, (path, fields, refused.text)
            assert refused.json()["error"]["code"] == code, (path, fields, refused.text)


async def step_with_server_killed_as_it_loads(
    monkeypatch: Any, backend: Any, model: Any, take_step: Callable[[], Awaitable[int]]
) -> int:
    """Take a step (`take_step`) whose adapter load meets a server SIGKILLed 2 ms after the load was sent:
    the step must come back as the next one, served by a new server process. Returns the step."""
    service = backend.inference
    assert service is not None
    next_name = f"{model.name}@{await model.get_step() + 1}"
    killed = _kill_server_as_it_loads(monkeypatch, service, next_name)
    step = await take_step()
    assert f"{model.name}@{step}" == next_name and killed and service.process.pid != killed[0]
    return step


def _kill_server_as_it_loads(monkeypatch: Any, service: Any, adapter: str) -> list[int]:
    """SIGKILL the tree of `service`'s server 2 ms after its load of `adapter` was sent (once); the list
    returned gets the killed pid."""
    from art_sglang.serving.servers.client import ServerClient

    load = ServerClient.load_lora_adapter
    killed: list[int] = []

    async def load_as_the_server_dies(client: ServerClient, name: str, path: str) -> Any:
        if name != adapter or killed:
            return await load(client, name, path)
        request = asyncio.ensure_future(load(client, name, path))
        await asyncio.sleep(0.002)  # the load is on its way
        killed.append(kill_tree(service.process.pid))
        return await request

    monkeypatch.setattr(ServerClient, "load_lora_adapter", load_as_the_server_dies)
    return killed


async def choice_of_stream(stream: Any, extra_field: str) -> Any:
    """A streamed chat completion's chunks put together as one Choice (content, logprob entries, finish
    reason), with `extra_field` of its last chunk's choice."""
    from openai.types.chat.chat_completion import Choice

    content, entries, last = "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            entries += [e.model_dump() for e in (choice.logprobs.content or [])] if choice.logprobs else []
            last = choice if choice.finish_reason is not None else last
    assert last is not None, "the stream ended without a finish reason"
    return Choice.model_validate(
        {"index": 0, "finish_reason": last.finish_reason, "logprobs": {"content": entries},
         "message": {"role": "assistant", "content": content}, extra_field: (last.model_extra or {})[extra_field]}
    )  # fmt: skip
