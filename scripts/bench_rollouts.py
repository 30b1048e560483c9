"""ART's rollout requests through `SGLangBackend` and on engines served directly (vLLM as ART serves it,
with LoRA or base weights; SGLang with the backend's exact flags): output tokens/s, request latency, the
cached share of prompt tokens, with ART's client and a bare one on every side (`rollout_targets.py`; the
workloads: `rollout_workloads.py`).

Every rollout is its own non-streamed chat request with logprobs, as ART's rollouts ask, on a random
LoRA adapter (`bench_common.make_random_adapter`, rank `--lora-rank`). Runs, `KIND-TOKENS:GROUPS[@CLIENT]`
(`@bare` or `@art`: that client only, else every `--clients`):

- `grpo-N:G`: G groups x `--group-size` rollouts of N tokens (`ignore_eos`); a group's rollouts send
  one identical ~`--prompt-tokens` prompt, groups share nothing, all groups at once;
- `varying-N:G`: the same without `ignore_eos`, up to N tokens; the end-of-sequence tokens get a
  `logit_bias` that makes a random-weight model end an answer after ~N/3 tokens on average, so answers
  differ in length as a trained model's do;
- `multiturn-N:G`: G groups x `--group-size` conversations of `--turns` turns of N tokens; a group's
  conversations start with the same prompt and each turn resends the conversation so far.

A run repeats waves of its pattern (fresh prompts each wave, as each RL step brings new ones) until
`--min-seconds` have passed; each configuration (route, prefill-sharing setting, client) runs `--repeats`
times, the configurations of a workload alternating (the order reversed every other repeat); tables show
medians and the spread (slowest and fastest repeat). Through the backend's gateway prefill sharing is on
(its default); the kinds in `--off-kinds` also run with it off (`gateway.set_prefill_sharing`; the JSON
calls the setting "merging"). `--ttft-requests` lone requests on the idle server (ART's client) measure
the time to first token (streamed) and the latency of a one-token request.

Sides, one per call (a GPU call of `run` is 10 minutes), each its own server start: `--side backend`
(`--engine sglang` or `reference`; `--routes gateway server`: through the gateway and straight to the
backend's own server; `--weights merged`: `weight_sync_method="merged"`, no LoRA kernels, measured after
`--train-steps` trained and pushed steps, default 1, where LoRA serves the random adapter as step 0
unless given); `--side direct --engine vllm|sglang|reference` (`--no-lora`: base weights;
`--flags backend [--drop ...]`: SGLang with the backend's launch, suspects removed). `--label` names a pass
(A/B/A: `--label A1`, then vLLM, then `--label A2`). `--compare A.json B.json ...` pools results into one
document with the ratios (`rollout_tables.py`). `--deadline-s` stops starting runs (the JSON is written
after each configuration) and `--resume` skips what the `--json` file already holds.

    python scripts/bench_rollouts.py --side backend --model /root/models/qwen2.5-1.5b-random \\
        --sampling-backend pytorch --label A1 --json backend-a1.json
    python scripts/bench_rollouts.py --side direct --engine vllm --model /root/models/qwen2.5-1.5b-random \\
        --attention-backend FLASH_ATTN --json vllm.json        # vLLM's python: $ART_SGLANG_VLLM_PYTHON
    python scripts/bench_rollouts.py --compare backend-a1.json vllm.json --json both.json --markdown both.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ (the trained steps)
from bench_common import (
    device_name,
    environment,
    gpu_processes,
    make_random_adapter,
    write_results,
)
from benchmark_inference import converse, percentile, prompt_body, summarize
from probe_rollout_costs import start_profiles
from rollout_options import parse_arguments, variant
from rollout_tables import compare, entry_key, table
from rollout_targets import (
    EVICTION_KEYS,
    ArtSender,
    Target,
    backend_targets,
    direct_targets,
)
from rollout_workloads import (
    RunSpec,
    Setting,
    eos_bias,
    rollout,
    run_settings,
    wave,
)

RESULT_KEYS = (
    "output_tokens_per_s",
    "latency_median_s",
    "latency_p99_s",
    "cached_share",
    "mean_completion_tokens",
    "server_cached_share",
)


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None or before is None:
        return None
    return {key: after[key] - before.get(key, 0) for key in after if isinstance(after[key], int | float)}


async def one_run(
    target: Target,
    client: str,
    http: httpx.AsyncClient,
    spec: RunSpec,
    args: argparse.Namespace,
    tag: str,
    body: str,
    bias: dict[str, float],
) -> dict[str, Any]:
    """Waves of `spec` back to back until `--min-seconds` have passed: the run's summary."""

    async def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
        return await rollout(target, client, messages, spec, bias)

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
        if "evictions" in server:
            summary["server_evictions"] = {key: server[key] for key in EVICTION_KEYS}
    return summary


def profile(target: Target, args: argparse.Namespace, run: str, repeat: int) -> list[Any]:
    """py-spy samplers of every server process over the first `--min-seconds` of the first repeat of
    `--profile-run` (raw stacks into `--profile-dir`), none otherwise."""
    if run != args.profile_run or repeat > 0 or args.profile_dir is None or target.server_pid is None:
        return []
    if shutil.which("py-spy") is None:
        print(f"no profile of {run}: py-spy is not on PATH", flush=True)
        return []
    return start_profiles(target.server_pid, args.min_seconds, args.profile_dir)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median over runs of each of RESULT_KEYS that the runs have."""
    return {
        key: statistics.median(r[key] for r in runs) for key in RESULT_KEYS if all(key in r for r in runs)
    }


def spread(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The slowest and fastest repeat's output tokens/s."""
    rates = [r["output_tokens_per_s"] for r in runs]
    return {"min": min(rates), "max": max(rates)}


def new_entry(document: dict[str, Any], spec: RunSpec, setting: Setting) -> dict[str, Any]:
    """A configuration's result entry, no runs yet."""
    server = {key: document[key] for key in ("side", "engine", "variant", "label")}
    workload = {"run": spec.name, "workload": spec.kind, "tokens": spec.tokens, "groups": spec.groups}
    return {**server, **setting._asdict(), **workload, "runs": []}


async def measure(
    targets: dict[str, Target],
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    document: dict[str, Any],
    body: str,
    started: float,
) -> None:
    """Every `--runs` configuration, `--repeats` times (configurations alternating), into
    `document["results"]`; the JSON is written after each workload."""
    done = {entry_key(e) for e in document["results"] if len(e["runs"]) >= args.repeats}
    for spec in args.runs:
        entries = {s: new_entry(document, spec, s) for s in run_settings(spec, targets, args)}
        todo = [s for s, entry in entries.items() if entry_key(entry) not in done]
        bias = document["varying_logit_bias"].get(str(spec.tokens), {})
        if not todo:
            print(f"{spec.name}: in {args.json} already", flush=True)
            continue
        for repeat in range(args.repeats):
            for setting in todo if repeat % 2 == 0 else todo[::-1]:  # no configuration always goes first
                if args.deadline_s and time.perf_counter() - started > args.deadline_s:
                    print(
                        f"deadline ({args.deadline_s} s): stopping before {spec.name} {setting}", flush=True
                    )
                    return
                target = targets[setting.route]
                target.set_merging(setting.merging)
                tag = f"[{args.side} {args.engine} {setting} {spec.name} r{repeat} {time.time():.3f}]"
                profiles = profile(target, args, spec.name, repeat)
                run = await one_run(target, setting.client, http, spec, args, tag, body, bias)
                for sampler in profiles:  # each ends after --min-seconds
                    await asyncio.to_thread(sampler.wait)
                entries[setting]["runs"].append(run)
                print(
                    f"{spec.name} {setting.route} merging={setting.merging} {setting.client} "
                    f"repeat {repeat + 1}/{args.repeats}: {run['output_tokens_per_s']:,.0f} tok/s, "
                    f"{run['waves']} waves in {run['wall_s']:.1f} s, cached {100 * run['cached_share']:.1f} %, "
                    f"prefill sharing {run['merge_counters']}, server evictions {run.get('server_evictions')}",
                    flush=True,
                )
        for setting in todo:
            runs = entries[setting]["runs"]
            entry = {**entries[setting], "median": medians(runs), "spread": spread(runs)}
            document["results"] = [e for e in document["results"] if entry_key(e) != entry_key(entry)]
            document["results"].append(entry)
        save(args, document)


async def lone_requests(target: Target, args: argparse.Namespace, body: str) -> dict[str, Any]:
    """`--ttft-requests` lone requests per merge setting on the idle server with ART's client, settings
    alternating: a streamed one (time to its first token) and a non-streamed one-token one (its latency)."""
    sender = target.senders["art"]
    assert isinstance(sender, ArtSender)
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
            stream = await sender.client.chat.completions.create(
                model=target.model, messages=messages, max_tokens=8, temperature=1.0, stream=True,
                extra_body={"ignore_eos": True, **target.extra},
            )  # fmt: skip
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            messages[0]["content"] = messages[0]["content"].replace("[lone", "[lone one-token", 1)
            one = time.perf_counter()
            await sender.chat(target.body(messages, 1, {}))
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


def new_document(args: argparse.Namespace) -> dict[str, Any]:
    """A side's result document: what ran, where (the machine's identity), and no results yet."""
    env = environment()
    return {
        "benchmark": "rollouts",
        "side": args.side,
        "engine": args.engine,
        "variant": variant(args),
        "label": args.label,
        "weights": args.weights if args.side == "backend" else ("lora" if args.lora else "base"),
        "device": device_name(env),
        "date": env["date"],
        "machine": {
            key: env[key] for key in ("time_utc", "gpu_details", "host", "cpu", "cpu_count", "commit")
        },
        "versions": dict(env["versions"]),
        "model": args.model,
        "model_description": model_description(args.model),
        "lora_rank": args.lora_rank,
        "prompt_tokens": args.prompt_tokens,
        "group_size": args.group_size,
        "turns": args.turns,
        "min_seconds": args.min_seconds,
        "repeats": args.repeats,
        "clients": {
            "art": "ART's: AsyncOpenAI on httpx, 20 min timeout, unbounded keep-alive pool",
            "bare": "aiohttp session, JSON posted as is, idle connections dropped after 2 s",
        },
        "results": [],
    }


def model_description(model: str) -> dict[str, Any]:
    """What the served model is: its architecture's sizes and vocabulary, and how it was built."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")  # fmt: skip
    described = {key: getattr(config, key, None) for key in keys}
    marker = Path(model) / "gpu_model.json"
    if marker.exists():
        described["built_by"] = {"script": "tests/gpu/gpu_models.py", **json.loads(marker.read_text())}
    return described


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One side's measurements: the result document (also written after each workload)."""
    started = time.perf_counter()
    document = new_document(args)
    if args.resume and args.json is not None and args.json.exists():
        previous = json.loads(args.json.read_text())
        mine = [document[key] for key in ("side", "engine", "variant", "label", "model")]
        if [previous.get(key) for key in ("side", "engine", "variant", "label", "model")] != mine:
            raise SystemExit(
                f"--resume: {args.json} holds another side, variant, pass or model; write elsewhere"
            )
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
    opened = backend_targets if args.side == "backend" else direct_targets
    async with (
        opened(args, adapter, document) as targets,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):
        print(
            f"{args.side} {args.engine} ({document['variant']}) serving after {document['start_s']:.1f} s",
            flush=True,
        )
        # Warm-up on every route and client: kernels compiled, the adapter in the GPU pool, pools opened;
        # its own prompts, nothing reused later.
        for target in targets.values():
            for client in target.senders:
                await one_run(
                    target, client, http, RunSpec("grpo", 8, 2), _warmup(args), "[warm-up]", body, {}
                )
        document["gpu_processes"] = gpu_processes()
        first = next(iter(targets.values()))
        if args.ttft_requests and "art" in first.senders:
            document["lone_requests"] = await lone_requests(first, args, body)
            print(f"lone requests: {json.dumps(_without_lists(document['lone_requests']))}", flush=True)
            save(args, document)
        await measure(targets, http, args, document, body, started)
        complete = sum(len(e["runs"]) >= args.repeats for e in document["results"])
        wanted = sum(len(run_settings(s, targets, args)) for s in args.runs)
        print(f"{complete} of {wanted} configurations measured" + ("" if complete >= wanted else
              ": call again with --resume for the rest"), flush=True)  # fmt: skip
    document["wall_s"] = time.perf_counter() - started
    return document


def _warmup(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "group_size": 4, "min_seconds": 0.0})


def _without_lists(lone: dict[str, Any]) -> dict[str, Any]:
    return {label: {k: v for k, v in row.items() if not isinstance(v, list)} for label, row in lone.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__, sys.argv[1:] if argv is None else argv)
    if args.compare:
        document = compare([json.loads(path.read_text()) for path in args.compare])
    else:
        document = asyncio.run(run(args))
    write_results(args, document, table(document))


if __name__ == "__main__":
    main()
