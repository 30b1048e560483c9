"""Where `bench_rollouts.py` sends its rollouts, and with which client.

Clients (`CLIENTS`), both on every side:
- `art`: ART's own (`AsyncOpenAI` on httpx with an unbounded keep-alive pool, as `art.Model.openai_client()`
  builds it, `bench_common.art_openai_client`): what an ART program gets from a server, its client's cost
  included;
- `bare`: one aiohttp session posting the JSON (near-zero client cost), idle connections dropped after
  `BARE_KEEP_ALIVE_S`, below the servers' 5 s keep-alive, so no request meets a connection the server is
  closing. The engines' ratio is this client's.

Targets:
- the backend (`SGLangBackend`: step 0 is the random adapter), by route: `gateway` (the model's own client
  URL: the gateway, prefill sharing switchable) or `server` (the backend's own SGLang server with the key
  the gateway holds, the body as the gateway forwards it: `lora_path` or, merged, the base id, and
  `return_token_ids`), so one live backend splits the gateway's cost from the server's. `--weights lora`
  serves the adapter with LoRA kernels; `--weights merged` (`weight_sync_method="merged"`) starts the server
  without them and the trainer pushes the adapter merged into the base weights. `--train-steps` steps
  (char_share rollouts through ART's client, `backend.train`) run first: merged, at least one, so what is
  measured is weights a trained step pushed;
- an engine served directly (`scripts/inference_engines.py`): vLLM with LoRA as ART serves it, or without
  LoRA (`--no-lora`: base weights, the stand-in for ART's `rollout_weights_mode="merged"`), or SGLang, with
  the bench's flags or (`--flags backend`) with exactly the flags, keys and request form the backend
  launches and sends, each of `--drop` removed (`DROPS`).

Issue 39's decode stalls (the backend's server stalled ~0.5 s every ~1.3 s, SGLang served directly did not):
`--no-watchdog` keeps the backend's watchdog from probing its server (`GET /health` every ~2 s), and
`--beside-trainer` starts the backend's trainer worker, idle after its init as the backend's is, on the
direct server's GPU. Both sides report the trainer's CPU seconds over the runs (`trainer_cpu_s`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx
from bench_common import art_openai_client, server_config, server_settings, version_in
from inference_engines import EngineServer
from probe_rollout_costs import server_processes

from art_sglang.process_tree import gather_all
from art_sglang.serving.servers.sglang_site import art_sglang_backports

ADAPTER = "rollouts@0"
CLIENTS = ("art", "bare")
ROUTES = ("gateway", "server")
BARE_KEEP_ALIVE_S = 2.0
# What `--flags backend --drop NAME` removes from the backend's launch: each a suspect for the cost of the
# backend's own path against SGLang served directly (issue 39, item 2).
DROPS: dict[str, dict[str, Any]] = {
    "memory-saver": {"enable_memory_saver": False, "enable_weights_cpu_backup": False},
    "weights-backup": {"enable_weights_cpu_backup": False},
    "metrics": {"enable_metrics": False},
    "tool-parser": {"tool_call_parser": None},
    # SGLang then reports logprobs after the temperature (vLLM reports raw ones, as the trainer scores).
    "original-logprob": {"server_env": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}},
    "keys": {},  # no --api-key/--admin-api-key (their --config file): handled where the keys are made
    "token-ids": {},  # requests without return_token_ids: handled in the request form
    # SGLang as released: none of art_sglang's backports (serving/servers/sglang_site/), or all but one.
    "backports": {"server_env": {"ART_SGLANG_BACKPORTS": "none"}},
    **{
        name: {"server_env": {"ART_SGLANG_BACKPORTS": art_sglang_backports.without(name)}}
        for name in art_sglang_backports.selection(None)
    },
}
SECRET_FIELDS = ("api_key", "admin_api_key")
WATCHDOG_OFF_S = 1e9  # each pause of a silenced watchdog: it never probes while the bench runs


class Sender(Protocol):
    async def chat(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class ArtSender:
    """ART's client (or anything with its `chat.completions.create`)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, base_url: str, api_key: str) -> ArtSender:
        return cls(art_openai_client(base_url, api_key))

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        standard = ("model", "messages", "max_tokens", "temperature", "logprobs")
        extra = {key: value for key, value in body.items() if key not in standard}
        response = await self.client.chat.completions.create(
            **{key: body[key] for key in standard}, extra_body=extra or None
        )
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None)
        return {
            "text": response.choices[0].message.content or "",
            "completion_tokens": usage.completion_tokens if usage else 0,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
        }

    async def close(self) -> None:
        await self.client.close()


class BareSender:
    """A bare aiohttp session posting chat requests to `base_url` (ending in /v1)."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.url = f"{base_url}/chat/completions"
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=BARE_KEEP_ALIVE_S)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.session = aiohttp.ClientSession(
            connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=1200)
        )

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url, json=body) as response:
            payload = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"{self.url} -> {response.status}: {str(payload)[:300]}")
        usage = payload.get("usage") or {}
        return {
            "text": payload["choices"][0]["message"].get("content") or "",
            "completion_tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        }

    async def close(self) -> None:
        await self.session.close()


def senders(base_url: str, api_key: str | None, clients: list[str]) -> dict[str, Sender]:
    made: dict[str, Sender] = {}
    for client in clients:
        made[client] = (
            ArtSender.connect(base_url, api_key or "none")
            if client == "art"
            else BareSender(base_url, api_key)
        )
    return made


class Target:
    """One route to a model: its senders by client, the body fields it adds, the side's prefill-sharing
    switch and counters, and the engine's prefix-cache counters."""

    def __init__(
        self,
        model: str,
        senders: dict[str, Sender],
        *,
        extra: dict[str, Any] | None = None,
        gateway: Any = None,
        metrics_url: str | None = None,
        engine: EngineServer | None = None,
        server_pid: int | None = None,
    ) -> None:
        self.model = model
        self.senders = senders
        self.extra = dict(extra or {})
        self.gateway = gateway
        self.metrics_url = metrics_url
        self.engine = engine
        self.server_pid = server_pid  # the root of the server's process tree (--profile-run samples it)

    def body(self, messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        """A rollout as ART sends it: non-streamed, temperature 1, logprobs on."""
        return {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
                "logprobs": True, **self.extra, **extra}  # fmt: skip

    def merge_settings(self, wanted: list[str]) -> list[str | None]:
        """The merge settings to run: `wanted` through the backend's gateway, None (no switch) elsewhere."""
        if self.gateway is None:
            return [None]
        if not hasattr(self.gateway, "set_prefill_sharing"):
            print("this gateway has no set_prefill_sharing(): one setting, as it forwards", flush=True)
            return [None]
        return list(wanted)

    def set_merging(self, setting: str | None) -> None:
        if setting is not None:
            self.gateway.set_prefill_sharing(setting == "on")

    def merge_counters(self) -> dict[str, int] | None:
        counters = getattr(self.gateway, "prefill_counters", None)
        return dict(counters()) if counters is not None else None

    async def cache_counters(self, http: httpx.AsyncClient) -> dict[str, float] | None:
        """Prompt and cached tokens the engine counted since its start (SGLang's /metrics, vLLM's
        prefix-cache counters), or None."""
        if self.engine is not None and self.engine.engine == "vllm":
            counters = await self.engine.prefix_cache_counters(http)
            return None if counters is None else {"prompt": counters["queries"], "cached": counters["hits"]}
        if self.metrics_url is None:
            return None
        response = await http.get(self.metrics_url)
        if response.status_code != 200:
            return None
        return parse_sglang_cache_counters(response.text)

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.close()


# SGLang's counters the bench reads: prompt and cached tokens, and its radix cache's evictions (tokens, calls,
# seconds; calls of `SLOW_EVICTION_S` or more from the histogram's bucket): issue 39's decode stalls began as
# the KV pool filled, i.e. as every decode step started evicting (scripts/device/suite.sh stall-*).
SGLANG_COUNTERS = {
    "sglang:prompt_tokens_total": "prompt",
    "sglang:cached_tokens_total": "cached",
    "sglang:evicted_tokens_total": "evicted_tokens",
    "sglang:eviction_duration_seconds_count": "evictions",
    "sglang:eviction_duration_seconds_sum": "eviction_s",
}
SLOW_EVICTION_S = "0.1"  # a bucket bound of SGLang 0.5.17's eviction histogram
EVICTION_KEYS = ("evicted_tokens", "evictions", "eviction_s", "slow_evictions")


def parse_sglang_cache_counters(metrics: str) -> dict[str, float] | None:
    """`{"prompt": tokens, "cached": tokens}` from SGLang's Prometheus text (summed over label sets), with
    the eviction counters of `EVICTION_KEYS` where it has them; None when it lacks either token counter."""
    totals: dict[str, float] = {}
    fast = 0.0  # evictions that took less than SLOW_EVICTION_S
    for line in metrics.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit(" ", 1)[-1]
        key = SGLANG_COUNTERS.get(name.strip())
        if key is not None:
            totals[key] = totals.get(key, 0.0) + float(value)
        elif name.strip() == "sglang:eviction_duration_seconds_bucket" and f'le="{SLOW_EVICTION_S}"' in rest:
            fast += float(value)
    if "evictions" in totals:
        totals["slow_evictions"] = totals["evictions"] - fast
    return totals if {"prompt", "cached"} <= set(totals) else None


def scrubbed(info: Any) -> Any:
    """A server's /server_info without its keys, at any depth (SGLang shows them as they are)."""
    if isinstance(info, dict):
        return {
            key: "<set>" if key in SECRET_FIELDS and value else scrubbed(value) for key, value in info.items()
        }
    return [scrubbed(item) for item in info] if isinstance(info, list) else info


async def server_info(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """SGLang's /server_info (its launch arguments as it settled them: CUDA-graph batch sizes, chunked
    prefill, KV-cache tokens...), keys scrubbed; None where the server has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    for path in ("/server_info", "/get_server_info"):  # the second is the older name SGLang still answers
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = await http.get(base_url + path, headers=headers)
            if response.status_code == 200:
                return scrubbed(response.json())
    return None


def launch_record(process: Any) -> dict[str, Any]:
    """A server process's command line, the environment it adds to this process's (keys are in a file
    its command names, never on it) and, for SGLang, the backports its environment chooses (the inherited
    `ART_SGLANG_BACKPORTS` included)."""
    environment = process.environment()
    added = {k: v for k, v in environment.items() if os.environ.get(k) != v}
    record = {"command": process.command(), "environment": added}
    if getattr(process, "engine", None) == "sglang":  # what SGLang runs is SGLang plus these backports
        record["backports"] = art_sglang_backports.selection(environment.get(art_sglang_backports.SELECT_ENV))
    return record


def backend_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """SGLangBackend's settings of a bench run (the server's flags from the command line, metrics on)."""
    from art_sglang.config import SGLangConfig, TrainerConfig

    share = {"share_prefill": True} if "share_prefill" in SGLangConfig.model_fields else {}
    sync = {"weight_sync_method": "merged"} if args.weights == "merged" else {}
    return {
        "engine": args.engine,
        "sglang_config": server_config(args, enable_metrics=True, **share, **sync),
        "trainer_config": TrainerConfig(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank),
    }


def backend_launch_config(args: argparse.Namespace) -> Any:
    """The server settings `SGLangBackend` settles for these arguments before it starts anything (shared
    mode's memory saver, the trainer's modules), with each of `--drop` removed. A fraction left to the plan
    ('auto') is sized only at register, so exact flags need one set."""
    import art_sglang as art

    if args.mem_fraction_static is None:
        raise SystemExit(
            "--flags backend needs a fixed --mem-fraction-static (the plan sizes 'auto' at register)"
        )
    config = art.SGLangBackend(**backend_arguments(args)).sglang_config
    changes: dict[str, Any] = {}
    for name in args.drop:
        for field, value in DROPS[name].items():
            changes[field] = {**config.server_env, **value} if field == "server_env" else value
    return config.model_validate({**config.model_dump(exclude_unset=True), **changes})


@contextlib.asynccontextmanager
async def backend_targets(
    args: argparse.Namespace, adapter: Path, document: dict[str, Any]
) -> AsyncIterator[dict[str, Target]]:
    """`SGLangBackend` serving a model whose step 0 is the random adapter (a checkpoint of adapter files
    only, as ART's LocalBackend writes, is resumed as it is), trained `--train-steps` steps: a target per
    `--routes`."""
    import art_sglang as art
    from art_sglang.storage.model_store import ModelStore

    path = args.workdir / "backend" / ".art"
    shutil.rmtree(path, ignore_errors=True)  # a step 0 of another model shape must not be resumed
    shutil.copytree(adapter, ModelStore(path, "bench-rollouts", "rollouts").checkpoint_dir(0))
    backend = art.SGLangBackend(path=str(path), **backend_arguments(args))
    model = art.TrainableModel(name="rollouts", project="bench-rollouts", base_model=args.model)
    # The watchdog (started at register) reads its interval before each pause: silenced for the backend's life.
    silenced = watchdog_silenced(not args.watchdog)
    async with silenced, backend, httpx.AsyncClient(timeout=60, trust_env=False) as http:
        start = time.perf_counter()
        await model.register(backend)
        document["watchdog"] = args.watchdog
        document["start_s"] = time.perf_counter() - start
        document["layout"] = backend.layout.describe()
        document["sglang_config"] = backend.sglang_config.model_dump(mode="json", exclude=set(SECRET_FIELDS))
        if args.engine == "sglang":
            document["versions"]["sglang"] = version_in(
                backend.sglang_config.resolved_server_python(), "sglang"
            )
        document["trained_steps"] = await train_steps(backend, model, args.train_steps)
        document["served_step"] = await model.get_step()
        assert backend.inference is not None
        process = backend.inference.process  # read after the steps: a handoff may restart the server
        document["launch"] = launch_record(process)
        server_key = process.config.api_key
        document["server_info"] = await server_info(http, process.base_url, server_key)
        metrics = f"{process.base_url}/metrics"
        assert model.inference_base_url is not None and model.inference_api_key is not None
        name = model.get_inference_name()
        targets = {}
        for route in args.routes:
            if route == "gateway":
                made = senders(model.inference_base_url, model.inference_api_key, args.clients)
                gateway = backend.inference.gateway
                targets[route] = Target(
                    name, made, gateway=gateway, metrics_url=metrics, server_pid=process.pid
                )
            else:  # the backend's own server, as the gateway forwards a rollout on an adapter (or an alias)
                made = senders(f"{process.base_url}/v1", server_key, args.clients)
                if args.weights == "merged":
                    served = await base_model_id(http, process.base_url, server_key)
                    extra: dict[str, Any] = {"return_token_ids": True}
                else:
                    served, extra = name, {"lora_path": name, "return_token_ids": True}
                targets[route] = Target(
                    served, made, extra=extra, metrics_url=metrics, server_pid=process.pid
                )
        trainer_cpu = process_cpu_s(backend.trainer(model).pid)
        try:
            yield targets
        finally:
            document["trainer_cpu_s"] = process_cpu_s(backend.trainer(model).pid) - trainer_cpu
            for target in targets.values():
                await target.close()


@contextlib.asynccontextmanager
async def watchdog_silenced(silent: bool) -> AsyncIterator[None]:
    """Inside the block (when `silent`) a backend's watchdog that starts or wakes waits `WATCHDOG_OFF_S`
    before its next probe, i.e. never probes its server during a bench."""
    from art_sglang.serving.servers import watchdog

    interval = watchdog.WATCHDOG_INTERVAL_S
    if silent:
        watchdog.WATCHDOG_INTERVAL_S = WATCHDOG_OFF_S
    try:
        yield
    finally:
        watchdog.WATCHDOG_INTERVAL_S = interval


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user and system) of the process `pid` and its descendants so far; 0 if it is not running."""
    return 0.0 if pid is None else sum(seconds for _, seconds in server_processes(pid).values())


async def train_steps(backend: Any, model: Any, steps: int) -> list[dict[str, Any]]:
    """`steps` training steps as an ART program takes them (char_share rollouts through ART's client, a
    learning rate for real models): each step's metrics (its sync time among them)."""
    from environments.char_share import CharShareTask
    from environments.common import REAL_LEARNING_RATE, train_loop

    done = []
    for seed in range(steps):
        [report] = await train_loop(backend, model, CharShareTask(max_tokens=16), steps=1, groups_per_step=2,
                                    group_size=4, learning_rate=REAL_LEARNING_RATE, seed=seed)  # fmt: skip
        done.append({"step": await model.get_step(), "metrics": dict(report.train_metrics)})
        print(f"trained step {done[-1]['step']}: {json.dumps(done[-1]['metrics'])}", flush=True)
    return done


async def base_model_id(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The id the server serves its own weights by (what the gateway rewrites a merged step's name to)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    response = await http.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return next(card["id"] for card in response.json()["data"] if card.get("parent") is None)


@contextlib.asynccontextmanager
async def direct_targets(
    args: argparse.Namespace, adapter: Path, document: dict[str, Any]
) -> AsyncIterator[dict[str, Target]]:
    """The engine's own server with the random adapter loaded at run time, as ART's LocalBackend serves
    vLLM (LoRA on, prefix caching on); with `--no-lora` the base weights alone (vLLM without LoRA)."""
    settings = server_settings(args, lora=args.lora)
    config = keys = None
    if args.flags == "backend":
        config = backend_launch_config(args)
        document["sglang_config"] = config.model_dump(mode="json", exclude=set(SECRET_FIELDS))
        if "keys" not in args.drop:  # as the backend's group: a key for the ordinary routes, one for admin
            keys = (secrets.token_hex(32), secrets.token_hex(32))
    server = EngineServer(args.engine, settings, log_path=args.workdir / f"server-{args.engine}.log",
                          config=config, keys=keys)  # fmt: skip
    if args.engine != "reference":
        document["versions"][args.engine] = version_in(server.interpreter(), args.engine)
    api_key = keys[0] if keys else None
    trainer = idle_trainer(args) if args.beside_trainer else None
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        try:
            start = time.perf_counter()
            # Started together, as the backend starts its server and trainer.
            await gather_all(server.start(), *([trainer.start()] if trainer else []))
            document["start_s"] = time.perf_counter() - start
            if trainer is not None:
                document["beside_trainer"] = {"pid": trainer.pid, **trainer.info}
            document["launch"] = launch_record(server.process)
            if args.engine != "vllm":
                document["server_info"] = await server_info(http, server.base_url, api_key)
            extra: dict[str, Any] = {}
            if not args.lora:
                model = args.model
            elif args.engine != "vllm" and args.request_form == "gateway":
                model, extra = ADAPTER, {"lora_path": ADAPTER}
                if "token-ids" not in args.drop:
                    extra["return_token_ids"] = True
            else:
                model = server.adapter_model(ADAPTER)
            if args.lora:
                await server.load_adapter(http, ADAPTER, adapter)
            metrics = f"{server.base_url}/metrics" if args.engine != "vllm" else None
            made = senders(f"{server.base_url}/v1", api_key, args.clients)
            target = Target(
                model, made, extra=extra, metrics_url=metrics, engine=server, server_pid=server.process.pid
            )
            trainer_cpu = process_cpu_s(trainer.pid if trainer else None)
            try:
                yield {"server": target}
            finally:
                if trainer is not None:
                    document["trainer_cpu_s"] = process_cpu_s(trainer.pid) - trainer_cpu
                await target.close()
        finally:
            await gather_all(server.stop(), *([trainer.stop()] if trainer else []))


def idle_trainer(args: argparse.Namespace) -> Any:
    """The trainer worker the backend would start for these arguments, on this process's GPU (its step 0 a
    fresh adapter in the workdir); it stays idle once started, as the backend's does until a step."""
    from art_sglang.training.process import TrainerProcess

    checkpoints = args.workdir / "beside-trainer"
    shutil.rmtree(checkpoints, ignore_errors=True)
    config = backend_arguments(args)["trainer_config"]
    return TrainerProcess(
        args.model, checkpoints, config, gpu_ids=None, log_path=args.workdir / "trainer.log"
    )
