"""ART's rollout requests through `SGLangBackend` (group-aware forwarding on and off) and on an engine
served directly (vLLM as ART serves it): output tokens/s, request latency, the cached share of prompt
tokens and the gateway's prefill-sharing counters, then the ratios backend / vLLM.

Every rollout is its own non-streamed chat request with logprobs, as ART's rollouts ask, on a random
LoRA adapter (`bench_common.make_random_adapter`, rank `--lora-rank`), sent with ART's own client on both
sides (`bench_common.art_openai_client`). Runs, `KIND-TOKENS:GROUPS`:

- `grpo-N:G`: G groups x `--group-size` rollouts of N tokens (`ignore_eos`); a group's rollouts send
  one identical ~`--prompt-tokens` prompt, groups share nothing, all groups at once;
- `varying-N:G`: the same without `ignore_eos`, up to N tokens; the end-of-sequence tokens get a
  `logit_bias` that makes a random-weight model end an answer after ~N/3 tokens on average, so answers
  differ in length as a trained model's do;
- `multiturn-N:G`: G groups x `--group-size` conversations of `--turns` turns of N tokens; a group's
  conversations start with the same prompt and each turn resends the conversation so far.

A run repeats waves of its pattern (fresh prompts each wave, as each RL step brings new ones) until
`--min-seconds` have passed; each configuration runs `--repeats` times; tables show medians over the
repeats. Through the backend every run has the gateway's prefill sharing on (its default), and the kinds
in `--off-kinds` also run with it off, the two settings alternating on one live backend
(`gateway.set_prefill_sharing`; the JSON calls the setting "merging"). `--ttft-requests`
lone requests on the idle server measure the time to first token (streamed) and the latency of a
one-token request (as ART sends them), with prefill sharing on and off.

Sides (one per call; a GPU call of `run` is 10 minutes): `--side backend` starts `SGLangBackend`
(`--engine sglang` or `reference`) and sends through `model.openai_client()` (the gateway);
`--side direct` starts an engine's own server (`--engine vllm`, `sglang` or `reference`,
`scripts/inference_engines.py`). `--compare A.json B.json ...` pools earlier results into one table with
the ratios. `--deadline-s` stops starting runs (the JSON is written after each configuration) and
`--resume` skips what the `--json` file already holds, so a second call finishes a cut one.

    python scripts/bench_rollouts.py --side backend --model /root/models/qwen2.5-1.5b-shape \\
        --sampling-backend pytorch --json sglang.json
    python scripts/bench_rollouts.py --side direct --engine vllm --model /root/models/qwen2.5-1.5b-shape \\
        --attention-backend FLASH_ATTN --json vllm.json        # vLLM's python: $ART_SGLANG_VLLM_PYTHON
    python scripts/bench_rollouts.py --compare sglang.json vllm.json --json both.json --markdown both.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    art_openai_client,
    device_name,
    environment,
    make_random_adapter,
    markdown_table,
    server_config,
    server_settings,
    version_in,
    write_results,
)
from benchmark_inference import Conversation, converse, percentile, prompt_body, summarize
from inference_engines import EngineServer

ADAPTER = "rollouts@0"
KINDS = ("grpo", "varying", "multiturn")
# Most wanted first, so a run cut by --deadline-s has them (issue 26's goals: 32 and 16 groups of 128
# tokens, answers of varying length, multi-turn; then the longer answers).
DEFAULT_RUNS = (
    "grpo-128:32",
    "grpo-128:16",
    "varying-384:32",
    "multiturn-64:32",
    "grpo-384:32",
    "grpo-384:16",
)
# Where the gateway's prefill sharing must be shown not to slow rollouts down (answers of varying length,
# multi-turn); fixed-length GRPO runs measure the default setting alone, to keep a GPU call within its time.
OFF_KINDS = ("varying", "multiturn")
RESULT_KEYS = (
    "output_tokens_per_s",
    "latency_median_s",
    "latency_p99_s",
    "cached_share",
    "mean_completion_tokens",
    "server_cached_share",
)


@dataclass(frozen=True)
class RunSpec:
    """One workload: `kind` (grpo, varying, multiturn), its tokens per answer, its number of groups."""

    kind: str
    tokens: int
    groups: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.tokens}:{self.groups}"


def run_spec(text: str) -> RunSpec:
    """`KIND-TOKENS:GROUPS`, e.g. `grpo-128:32`."""
    head, _, groups = text.partition(":")
    kind, _, tokens = head.partition("-")
    if kind not in KINDS or not tokens.isdigit() or not groups.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: use KIND-TOKENS:GROUPS with KIND in {KINDS}")
    return RunSpec(kind, int(tokens), int(groups))


def run_settings(spec: RunSpec, args: argparse.Namespace) -> list[str]:
    """The prefill-sharing settings `spec` runs with through the backend."""
    return ["on", "off"] if spec.kind in args.off_kinds else ["on"]


def eos_bias(model: str, mean_tokens: float) -> dict[str, float]:
    """`logit_bias` on the model's end-of-sequence tokens that makes a model with near-uniform next-token
    probabilities (random weights) end after ~`mean_tokens` tokens: P(eos) = 1 / mean_tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    ids = {AutoTokenizer.from_pretrained(model).eos_token_id}
    with contextlib.suppress(OSError):  # a model folder without generation_config.json
        found = GenerationConfig.from_pretrained(model).eos_token_id
        ids |= set(found) if isinstance(found, list) else {found}
    ids.discard(None)
    bias = math.log((vocab - len(ids)) / (len(ids) * max(mean_tokens - 1, 1.0)))
    return {str(i): round(bias, 3) for i in sorted(ids)}


class Target:
    """Where the requests go: a client, the `model` to name, the side's merge switch and counters, and
    the engine's own prefix-cache counters."""

    def __init__(
        self,
        client: AsyncOpenAI,
        model: str,
        *,
        backend: Any = None,
        metrics_url: str | None = None,
        engine: EngineServer | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.gateway = getattr(getattr(backend, "inference", None), "gateway", None)
        self.metrics_url = metrics_url
        self.engine = engine

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
        if self.engine is not None:
            counters = await self.engine.prefix_cache_counters(http)
            return None if counters is None else {"prompt": counters["queries"], "cached": counters["hits"]}
        if self.metrics_url is None:
            return None
        response = await http.get(self.metrics_url)
        if response.status_code != 200:
            return None
        return parse_sglang_cache_counters(response.text)


def parse_sglang_cache_counters(metrics: str) -> dict[str, float] | None:
    """`{"prompt": tokens, "cached": tokens}` from SGLang's Prometheus text (summed over label sets), or
    None when it has neither counter."""
    totals: dict[str, float] = {}
    for line in metrics.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        for key, metric in (
            ("prompt", "sglang:prompt_tokens_total"),
            ("cached", "sglang:cached_tokens_total"),
        ):
            if name.strip() == metric:
                totals[key] = totals.get(key, 0.0) + float(rest.rsplit(" ", 1)[-1])
    return totals if len(totals) == 2 else None


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None or before is None:
        return None
    return {key: after[key] - before.get(key, 0) for key in after if isinstance(after[key], int | float)}


async def rollout(
    target: Target, messages: list[dict[str, str]], spec: RunSpec, bias: dict[str, float]
) -> dict[str, Any]:
    """One rollout request as ART sends it: non-streamed, logprobs on; its latency, tokens and cached
    prompt tokens."""
    extra: dict[str, Any] = {"ignore_eos": True} if spec.kind != "varying" else {"logit_bias": bias}
    start = time.perf_counter()
    response = await target.client.chat.completions.create(
        model=target.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=spec.tokens,
        temperature=1.0,
        logprobs=True,
        extra_body=extra,
    )
    usage = response.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "text": response.choices[0].message.content or "",
        "latency_s": time.perf_counter() - start,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
    }


def wave(spec: RunSpec, args: argparse.Namespace, tag: str, body: str) -> list[Conversation]:
    """One wave of `spec`: `group_size` conversations per group, the group's prompt shared."""
    turns = args.turns if spec.kind == "multiturn" else 1
    return [
        Conversation(
            f"{tag} group {g}. {body}", tuple(f"Turn {t} of game {g}: your move?" for t in range(turns))
        )
        for g in range(spec.groups)
        for _ in range(args.group_size)
    ]


async def one_run(
    target: Target,
    http: httpx.AsyncClient,
    spec: RunSpec,
    args: argparse.Namespace,
    tag: str,
    body: str,
    bias: dict[str, float],
) -> dict[str, Any]:
    """Waves of `spec` back to back until `--min-seconds` have passed: the run's summary."""

    async def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
        return await rollout(target, messages, spec, bias)

    counters, cache = target.merge_counters(), await target.cache_counters(http)
    chats: list[dict[str, Any]] = []
    waves = 0
    start = time.perf_counter()
    while waves == 0 or time.perf_counter() - start < args.min_seconds:
        done = await asyncio.gather(*(converse(c, chat) for c in wave(spec, args, f"{tag} w{waves}", body)))
        chats += [turn for conversation in done for turn in conversation]
        waves += 1
    summary = {**summarize(chats, time.perf_counter() - start), "waves": waves}
    summary["completion_tokens_range"] = [
        min(c["completion_tokens"] for c in chats),
        max(c["completion_tokens"] for c in chats),
    ]
    summary["merge_counters"] = _delta(target.merge_counters(), counters)
    server = _delta(await target.cache_counters(http), cache)
    if server is not None:
        summary["server_cached_share"] = server["cached"] / server["prompt"] if server["prompt"] else 0.0
    return summary


def entry_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (entry["side"], entry["engine"], entry["merging"], entry["run"])


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median over runs of each of RESULT_KEYS that the runs have."""
    return {
        key: statistics.median(r[key] for r in runs) for key in RESULT_KEYS if all(key in r for r in runs)
    }


async def measure(
    target: Target,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    document: dict[str, Any],
    body: str,
    started: float,
) -> None:
    """Every `--runs` configuration at every merge setting, `--repeats` times (settings alternating),
    into `document["results"]`; the JSON is written after each configuration."""
    done = {entry_key(e) for e in document["results"] if len(e["runs"]) >= args.repeats}
    for spec in args.runs:
        settings = target.merge_settings(run_settings(spec, args))
        entries = {
            s: {
                "side": args.side,
                "engine": args.engine,
                "merging": s,
                "run": spec.name,
                "workload": spec.kind,
                "tokens": spec.tokens,
                "groups": spec.groups,
                "runs": [],
            }
            for s in settings
        }
        todo = [s for s in settings if entry_key(entries[s]) not in done]
        bias = document["varying_logit_bias"].get(str(spec.tokens), {})
        if not todo:
            print(f"{spec.name}: in {args.json} already", flush=True)
            continue
        for repeat in range(args.repeats):
            for setting in todo if repeat % 2 == 0 else todo[::-1]:  # neither setting always goes first
                if args.deadline_s and time.perf_counter() - started > args.deadline_s:
                    print(
                        f"deadline ({args.deadline_s} s): stopping before {spec.name} {setting}", flush=True
                    )
                    return
                target.set_merging(setting)
                tag = f"[{args.side} {args.engine} {setting} {spec.name} r{repeat} {time.time():.3f}]"
                run = await one_run(target, http, spec, args, tag, body, bias)
                entries[setting]["runs"].append(run)
                print(
                    f"{spec.name} merging={setting} repeat {repeat + 1}/{args.repeats}: "
                    f"{run['output_tokens_per_s']:,.0f} tok/s, {run['waves']} waves in {run['wall_s']:.1f} s, "
                    f"cached {100 * run['cached_share']:.1f} %, prefill sharing {run['merge_counters']}",
                    flush=True,
                )
        for setting in todo:
            entry = {**entries[setting], "median": medians(entries[setting]["runs"])}
            document["results"] = [e for e in document["results"] if entry_key(e) != entry_key(entry)] + [
                entry
            ]
        save(args, document)


async def lone_requests(target: Target, args: argparse.Namespace, body: str) -> dict[str, Any]:
    """`--ttft-requests` lone requests per merge setting on the idle server, settings alternating: a
    streamed one (time to its first token) and a non-streamed one-token one (its latency)."""
    times: dict[str, dict[str, list[float]]] = {}
    settings = target.merge_settings(["on", "off"])
    for index in range(args.ttft_requests):
        for setting in settings if index % 2 == 0 else settings[::-1]:
            target.set_merging(setting)
            label = setting or "-"
            messages = [
                {"role": "system", "content": f"[lone {label} {index} {time.time():.3f}] {body}"},
                {"role": "user", "content": "Your move?"},
            ]
            start = time.perf_counter()
            stream = await target.client.chat.completions.create(
                model=target.model,
                messages=messages,
                max_tokens=8,
                temperature=1.0,
                stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            messages[0]["content"] = messages[0]["content"].replace("[lone", "[lone one-token", 1)
            one = time.perf_counter()
            await target.client.chat.completions.create(
                model=target.model,
                messages=messages,
                max_tokens=1,
                temperature=1.0,
                logprobs=True,  # type: ignore[arg-type]
            )
            row = times.setdefault(label, {"ttft_s": [], "one_token_s": []})
            row["ttft_s"].append(first if first is not None else one - start)
            row["one_token_s"].append(time.perf_counter() - one)
    return {
        label: {
            **{
                f"{key}_{stat}": fn(values)
                for key, values in row.items()
                for stat, fn in (("median", statistics.median), ("p90", lambda v: percentile(v, 0.9)))
            },
            "requests": len(row["ttft_s"]),
            **row,
        }
        for label, row in times.items()
    }


def save(args: argparse.Namespace, document: dict[str, Any]) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1, default=str))


@contextlib.asynccontextmanager
async def backend_target(
    args: argparse.Namespace, adapter: Path, document: dict[str, Any]
) -> AsyncIterator[Target]:
    """`SGLangBackend` serving a model whose step 0 is the random adapter (a checkpoint of adapter files
    only, as ART's LocalBackend writes, is resumed as it is): requests through the model's own client."""
    import art_sglang as art
    from art_sglang.config import SGLangConfig, TrainerConfig
    from art_sglang.storage.model_store import ModelStore

    path = args.workdir / "backend" / ".art"
    shutil.rmtree(path, ignore_errors=True)  # a step 0 of another model shape must not be resumed
    step0 = ModelStore(path, "bench-rollouts", "rollouts").checkpoint_dir(0)
    shutil.copytree(adapter, step0)
    merge = {"share_prefill": True} if "share_prefill" in SGLangConfig.model_fields else {}
    backend = art.SGLangBackend(
        path=str(path),
        engine=args.engine,
        sglang_config=server_config(args, enable_metrics=True, **merge),
        trainer_config=TrainerConfig(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank),
    )
    model = art.TrainableModel(name="rollouts", project="bench-rollouts", base_model=args.model)
    async with backend:
        start = time.perf_counter()
        await model.register(backend)
        document["start_s"] = time.perf_counter() - start
        document["layout"] = backend.layout.describe()
        document["sglang_config"] = backend.sglang_config.model_dump(mode="json")
        if args.engine == "sglang":
            python = backend.sglang_config.resolved_server_python()
            document["versions"]["sglang"] = version_in(python, "sglang")
        assert backend.inference is not None
        metrics = f"{backend.inference.process.base_url}/metrics"
        assert model.inference_base_url is not None and model.inference_api_key is not None
        client = art_openai_client(model.inference_base_url, model.inference_api_key)
        yield Target(client, model.get_inference_name(), backend=backend, metrics_url=metrics)
        await client.close()


@contextlib.asynccontextmanager
async def direct_target(
    args: argparse.Namespace, adapter: Path, document: dict[str, Any]
) -> AsyncIterator[Target]:
    """The engine's own server with the random adapter loaded at run time, as ART's LocalBackend serves
    vLLM (LoRA on, prefix caching on)."""
    server = EngineServer(
        args.engine, server_settings(args), log_path=args.workdir / f"server-{args.engine}.log"
    )
    if args.engine != "reference":
        document["versions"][args.engine] = version_in(server.interpreter(), args.engine)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        try:
            start = time.perf_counter()
            await server.start()
            document["start_s"] = time.perf_counter() - start
            document["command"] = server.command()
            await server.load_adapter(http, ADAPTER, adapter)
            client = art_openai_client(f"{server.base_url}/v1", "none")
            metrics = f"{server.base_url}/metrics" if args.engine == "sglang" else None
            yield Target(client, server.adapter_model(ADAPTER), metrics_url=metrics, engine=server)
            await client.close()
        finally:
            await server.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One side's measurements: the result document (also written after each configuration)."""
    started = time.perf_counter()
    env = environment()
    document: dict[str, Any] = {
        "benchmark": "rollouts",
        "side": args.side,
        "engine": args.engine,
        "device": device_name(env),
        "date": env["date"],
        "versions": dict(env["versions"]),
        "model": args.model,
        "lora_rank": args.lora_rank,
        "prompt_tokens": args.prompt_tokens,
        "group_size": args.group_size,
        "turns": args.turns,
        "min_seconds": args.min_seconds,
        "repeats": args.repeats,
        "client": "ART's: AsyncOpenAI on httpx, 20 min timeout, unbounded keep-alive pool",
        "results": [],
    }
    if args.resume and args.json is not None and args.json.exists():
        previous = json.loads(args.json.read_text())
        if (previous["side"], previous["engine"], previous["model"]) != (args.side, args.engine, args.model):
            raise SystemExit(f"--resume: {args.json} holds another side, engine or model; write elsewhere")
        document["results"] = previous["results"]
    adapter = make_random_adapter(
        args.model, args.workdir / f"adapter-r{args.lora_rank}", rank=args.lora_rank
    )
    body = prompt_body(args.model, args.prompt_tokens)
    document["varying_logit_bias"] = {
        str(s.tokens): eos_bias(args.model, args.varying_mean_fraction * s.tokens)
        for s in args.runs
        if s.kind == "varying"
    }
    opened = backend_target if args.side == "backend" else direct_target
    async with (
        opened(args, adapter, document) as target,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):
        print(f"{args.side} {args.engine} serving after {document['start_s']:.1f} s", flush=True)
        # Warm-up: kernels compiled, the adapter in the GPU pool; its own prompts, nothing reused later.
        await one_run(target, http, RunSpec("grpo", 8, 2), _warmup(args), "[warm-up]", body, {})
        if args.ttft_requests:
            document["lone_requests"] = await lone_requests(target, args, body)
            print(f"lone requests: {json.dumps(_without_lists(document['lone_requests']))}", flush=True)
            save(args, document)
        await measure(target, http, args, document, body, started)
        complete = sum(len(e["runs"]) >= args.repeats for e in document["results"])
        wanted = sum(len(target.merge_settings(run_settings(s, args))) for s in args.runs)
        print(f"{complete} of {wanted} configurations measured" + ("" if complete >= wanted else
              ": call again with --resume for the rest"), flush=True)  # fmt: skip
    document["wall_s"] = time.perf_counter() - started
    return document


def _warmup(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "group_size": 4, "min_seconds": 0.0})


def _without_lists(lone: dict[str, Any]) -> dict[str, Any]:
    return {label: {k: v for k, v in row.items() if not isinstance(v, list)} for label, row in lone.items()}


def compare(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Every document's entries pooled (a later document's entry replaces an earlier one's of the same
    key), with ratios of each backend entry to the direct vLLM entry of the same run."""
    models = {d["model"] for d in documents}
    if len(models) != 1:
        raise SystemExit(f"--compare: the results are of different models: {sorted(models)}")
    entries: dict[tuple[Any, ...], dict[str, Any]] = {}
    for document in documents:
        for entry in document["results"]:
            entries[entry_key(entry)] = {**entry, "device": document["device"], "date": document["date"]}
    vllm = {e["run"]: e for e in entries.values() if (e["side"], e["engine"]) == ("direct", "vllm")}
    ratios = []
    for entry in entries.values():
        theirs = vllm.get(entry["run"])
        if entry["side"] != "backend" or theirs is None:
            continue
        mine, other = entry["median"], theirs["median"]
        ratios.append(
            {
                "run": entry["run"],
                "merging": entry["merging"],
                **{
                    key: mine[key] / other[key]
                    for key in ("output_tokens_per_s", "latency_median_s", "latency_p99_s")
                    if key in mine and other.get(key)
                },
            }
        )
    return {
        "benchmark": "rollouts (compared)",
        "model": models.pop(),
        "versions": {k: v for d in documents for k, v in d["versions"].items() if v is not None},
        "sources": [
            {key: d.get(key) for key in ("side", "engine", "device", "date", "start_s", "wall_s")}
            for d in documents
        ],
        "results": list(entries.values()),
        "ratios_to_vllm": ratios,
        "lone_requests": {
            f"{d['side']} {d['engine']}": d["lone_requests"] for d in documents if "lone_requests" in d
        },
    }


def table(document: dict[str, Any]) -> str:
    """One row per (run, side, merging): medians, and the ratio to vLLM where there is one."""
    ratios = {(r["run"], r["merging"]): r for r in document.get("ratios_to_vllm", [])}
    headers = [
        "run",
        "side",
        "merging",
        "repeats",
        "output tok/s",
        "tok/s / vLLM",
        "latency p50 s",
        "latency p99 s",
        "cached",
        "server cached",
        "mean output tokens",
        "held (last run)",
    ]
    rows = []
    for e in sorted(document["results"], key=lambda e: (e["run"], e["side"], e["engine"], str(e["merging"]))):
        m = e["median"]
        ratio = ratios.get((e["run"], e["merging"])) if e["side"] == "backend" else None
        merges = e["runs"][-1].get("merge_counters") if e["runs"] else None
        rows.append(
            [
                e["run"],
                f"{e['side']} {e['engine']}",
                e["merging"] or "-",
                len(e["runs"]),
                m.get("output_tokens_per_s", 0.0),
                ratio["output_tokens_per_s"] if ratio else "-",
                m.get("latency_median_s", 0.0),
                m.get("latency_p99_s", 0.0),
                f"{100 * m.get('cached_share', 0.0):.1f}%",
                f"{100 * m['server_cached_share']:.1f}%" if "server_cached_share" in m else "-",
                round(m.get("mean_completion_tokens", 0.0)),
                merges.get("requests_held", "-") if merges else "-",
            ]
        )
    lone = document.get("lone_requests") or {}
    if "side" in document:  # one side's document
        lone = {f"{document['side']} {document['engine']}": lone} if lone else {}
    lines = [
        f"{source}, merging {label}: TTFT {1000 * row['ttft_s_median']:.1f} ms median "
        f"(p90 {1000 * row['ttft_s_p90']:.1f}), one-token request {1000 * row['one_token_s_median']:.1f} ms"
        for source, settings in lone.items()
        for label, row in settings.items()
    ]
    head = (
        f"{document['model']}; medians over repeats; output tokens/s over whole runs of waves; "
        f"ratio = backend / vLLM direct"
    )
    return "\n".join([head, "", markdown_table(headers, rows), *(["", *lines] if lines else [])])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser, engines=("sglang", "reference", "vllm"))
    parser.set_defaults(lora_rank=16)
    parser.add_argument("--side", choices=("backend", "direct"), default="backend")
    parser.add_argument(
        "--runs",
        type=run_spec,
        nargs="+",
        default=[run_spec(r) for r in DEFAULT_RUNS],
        metavar="KIND-TOKENS:GROUPS",
        help=f"default: {' '.join(DEFAULT_RUNS)}",
    )
    parser.add_argument(
        "--off-kinds",
        nargs="*",
        choices=KINDS,
        default=list(OFF_KINDS),
        help="backend side: the workloads that also run with prefill sharing off (default: %(default)s)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of a group's prompt body")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    parser.add_argument(
        "--varying-mean-fraction",
        type=float,
        default=1 / 3,
        help="varying: mean answer length as a share of the longest run's tokens",
    )
    parser.add_argument("--min-seconds", type=float, default=10.0, help="a run repeats waves this long")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=20, help="lone requests per setting (0: none)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no run after this many seconds since the script started",
    )
    parser.add_argument("--resume", action="store_true", help="skip configurations --json already holds")
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="pool these results (no server started) into --json/--markdown",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--compare" in argv and "--model" not in argv:
        argv = [*argv, "--model", "-"]  # --compare reads the model from the results
    args = parser.parse_args(argv)
    if args.compare:
        document = compare([json.loads(path.read_text()) for path in args.compare])
    else:
        if args.side == "backend" and args.engine == "vllm":
            parser.error("--side backend runs SGLangBackend: --engine sglang or reference")
        document = asyncio.run(run(args))
    write_results(args, document, table(document))


if __name__ == "__main__":
    main()
