"""scripts/bench_rollouts.py: its run loop against a fake gateway with a prefill-sharing switch (on and off
alternate, the counters are per run, --resume and --deadline-s), and end to end on CPU through
SGLangBackend on the reference engine (both clients, both routes), directly on the reference engine with
the backend's exact launch, then compared with a vLLM result made from it."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_rollouts  # noqa: E402
import rollout_options  # noqa: E402
import rollout_targets  # noqa: E402
import rollout_workloads  # noqa: E402


class FakeGateway:
    """The gateway's prefill-sharing switch and counters; each request counts as held while it is on."""

    def __init__(self) -> None:
        self.merging = True
        self.switches: list[bool] = []
        self.counters = {"requests_held": 0, "prefill_requests": 0}

    def set_prefill_sharing(self, enabled: bool) -> None:
        self.merging = enabled
        self.switches.append(enabled)

    def prefill_counters(self) -> dict[str, int]:
        return dict(self.counters)


class FakeCompletions:
    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway
        self.calls: list[dict[str, Any]] = []

    async def create(self, **params: Any) -> Any:
        self.calls.append({**params, "messages": list(params["messages"])})  # as sent, not as it grows
        if self.gateway.merging:
            self.gateway.counters["requests_held"] += 1
        if params.get("stream"):
            return self._stream()
        usage = SimpleNamespace(completion_tokens=params["max_tokens"], prompt_tokens=100,
                                prompt_tokens_details=SimpleNamespace(cached_tokens=75))  # fmt: skip
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="x"))], usage=usage)

    async def _stream(self) -> AsyncIterator[Any]:
        for text in ("a", "b"):
            yield SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=text))])


def fake_target() -> tuple[rollout_targets.Target, FakeGateway, FakeCompletions]:
    gateway = FakeGateway()
    completions = FakeCompletions(gateway)
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    senders = {"art": rollout_targets.ArtSender(client)}
    return rollout_targets.Target("m@0", senders, gateway=gateway), gateway, completions  # type: ignore[arg-type]


def loop_args(tmp_path: Path, **changes: Any) -> argparse.Namespace:
    values = {"side": "backend", "engine": "sglang", "off_kinds": ["grpo", "multiturn"], "repeats": 3, "min_seconds": 0.0,
              "clients": ["art"], "profile_run": None, "profile_dir": None,
              "deadline_s": None, "json": tmp_path / "out.json", "group_size": 8, "turns": 3,
              "runs": [rollout_workloads.run_spec("grpo-128:2"), rollout_workloads.run_spec("multiturn-64:1")]}  # fmt: skip
    return argparse.Namespace(**{**values, **changes})


async def test_merging_on_and_off_alternate_on_one_target(tmp_path: Path) -> None:
    target, gateway, completions = fake_target()
    args = loop_args(tmp_path)
    document: dict[str, Any] = {"results": [], "varying_logit_bias": {}, "side": "backend", "engine": "sglang",
                                "variant": "lora", "label": "A1"}  # fmt: skip
    await bench_rollouts.measure({"gateway": target}, None, args, document, "body", 0.0)  # type: ignore[arg-type]
    # Per run spec: on, off, then off, on, then on, off: neither setting always runs first.
    assert gateway.switches == [True, False, False, True, True, False] * 2
    entries = {(e["run"], e["merging"]): e for e in document["results"]}
    assert set(entries) == {(r, s) for r in ("grpo-128:2", "multiturn-64:1") for s in ("on", "off")}
    for (run, setting), entry in entries.items():
        assert len(entry["runs"]) == 3 and entry["median"]["cached_share"] == 0.75
        requests = 16 if run == "grpo-128:2" else 8 * 3  # multiturn: every turn is a request
        assert all(r["requests"] == requests for r in entry["runs"])
        merged = [r["merge_counters"]["requests_held"] for r in entry["runs"]]
        assert merged == ([requests] * 3 if setting == "on" else [0] * 3)
    # As ART's rollouts: non-streamed, logprobs on, ignore_eos for the fixed-length workloads.
    call = completions.calls[0]
    assert call["logprobs"] is True and "stream" not in call and call["extra_body"] == {"ignore_eos": True}
    assert all(
        e["label"] == "A1" and e["client"] == "art" and e["route"] == "gateway" for e in document["results"]
    )
    assert all(
        e["spread"]["min"] <= e["median"]["output_tokens_per_s"] <= e["spread"]["max"]
        for e in document["results"]
    )
    # The multiturn conversations resend their history: the third turn carries two answers.
    assert max(len(c["messages"]) for c in completions.calls) == 1 + 3 + 2
    assert json.loads(args.json.read_text())["results"] == document["results"]

    # --resume: what the document holds is not run again; --deadline-s: nothing starts after it.
    calls = len(completions.calls)
    await bench_rollouts.measure({"gateway": target}, None, args, document, "body", 0.0)  # type: ignore[arg-type]
    assert len(completions.calls) == calls
    late = loop_args(tmp_path, deadline_s=1.0, runs=[rollout_workloads.run_spec("varying-384:1")])
    await bench_rollouts.measure({"gateway": target}, None, late, document, "body", -10.0)  # type: ignore[arg-type]
    assert len(completions.calls) == calls and len(document["results"]) == 4

    # varying: no ignore_eos, the end-of-sequence bias of its length instead.
    varying = loop_args(tmp_path, repeats=1, runs=[rollout_workloads.run_spec("varying-384:1")])
    document["varying_logit_bias"] = {"384": {"2": 3.5}}
    await bench_rollouts.measure({"gateway": target}, None, varying, document, "body", 0.0)  # type: ignore[arg-type]
    assert completions.calls[-1]["extra_body"] == {"logit_bias": {"2": 3.5}} and len(document["results"]) == 5
    # A kind outside --off-kinds runs with prefill sharing on only.
    assert [e["merging"] for e in document["results"] if e["run"] == "varying-384:1"] == ["on"]


async def test_art_client_keeps_a_wave_of_connections_open() -> None:
    """ART's client (both sides of the comparison send through it) keeps every connection of a wave open
    afterwards, as ART's does: the cost of its idle pool with hundreds of rollouts in flight is part of what
    an ART user gets (the OpenAI SDK's default client keeps 100)."""
    from aiohttp import web
    from bench_common import art_openai_client

    transports: set[asyncio.BaseTransport] = set()
    inside = asyncio.Event()
    arrived = 0

    async def chat(request: web.Request) -> web.Response:
        nonlocal arrived
        assert request.transport is not None
        transports.add(request.transport)
        arrived += 1
        if arrived % 150 == 0:
            inside.set()
        await inside.wait()  # the wave's requests are all in flight at once
        message = {"role": "assistant", "content": "hi"}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}  # fmt: skip
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = art_openai_client(f"http://127.0.0.1:{runner.addresses[0][1]}/v1", "none")
    try:
        for _ in range(2):
            inside.clear()
            messages = [{"role": "user", "content": "hi"}]
            wave = (client.chat.completions.create(model="m", messages=messages) for _ in range(150))
            answers = await asyncio.wait_for(asyncio.gather(*wave), 60)
            assert all(a.choices[0].message.content == "hi" for a in answers)
            await asyncio.sleep(0.3)
            assert sum(not t.is_closing() for t in transports) == 150
    finally:
        await client.close()
        await runner.cleanup()


async def test_lone_requests_time_the_first_token_per_setting(tmp_path: Path) -> None:
    target, gateway, completions = fake_target()
    lone = await bench_rollouts.lone_requests(target, loop_args(tmp_path, ttft_requests=3), "body")
    assert set(lone) == {"on", "off"} and lone["on"]["requests"] == lone["off"]["requests"] == 3
    assert lone["on"]["ttft_s_median"] > 0 and lone["off"]["one_token_s_median"] > 0
    assert gateway.switches == [True, False, False, True, True, False]
    streamed = [c for c in completions.calls if c.get("stream")]
    assert len(streamed) == 6 and all(c["max_tokens"] == 8 for c in streamed)


def test_the_profiled_run_samples_every_server_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--profile-run: py-spy records each process of the server's tree over the first repeat of that run
    (here a stand-in py-spy that writes down its arguments), and nothing else is sampled."""
    spy = tmp_path / "bin" / "py-spy"
    spy.parent.mkdir()
    spy.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n')
    spy.chmod(0o755)
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])  # fmt: skip
    try:
        time.sleep(1.0)  # its child has started
        target = rollout_targets.Target("m", {}, server_pid=server.pid)
        args = argparse.Namespace(
            profile_run="grpo-1024:16", profile_dir=tmp_path / "profile", min_seconds=20.0
        )
        assert bench_rollouts.profile(target, args, "grpo-128:32", 0) == []
        assert bench_rollouts.profile(target, args, "grpo-1024:16", 1) == []
        monkeypatch.setenv("PATH", "/nonexistent")
        assert bench_rollouts.profile(target, args, "grpo-1024:16", 0) == []
        assert "py-spy is not on PATH" in capsys.readouterr().out
        monkeypatch.setenv("PATH", f"{spy.parent}:/usr/bin:/bin")
        for sampler in bench_rollouts.profile(target, args, "grpo-1024:16", 0):
            sampler.wait(timeout=30)
        calls = (tmp_path / "calls").read_text().splitlines()
        pids = {int(call.split(" -p ")[1].split()[0]) for call in calls}
        assert len(pids) == 2 and server.pid in pids and all(" -d 20 " in call for call in calls)
    finally:
        for child in psutil.Process(server.pid).children(recursive=True):
            child.kill()
        server.kill()
        server.wait()


def test_a_gateway_without_a_switch_runs_one_setting() -> None:
    target = rollout_targets.Target("m", {}, gateway=object())
    assert target.merge_settings(["on", "off"]) == [None] and target.merge_counters() is None
    assert rollout_targets.Target("m", {}).merge_settings(["on", "off"]) == [None]


def test_run_specs() -> None:
    spec = rollout_workloads.run_spec("varying-384:32")
    assert (spec.kind, spec.tokens, spec.groups, spec.name) == ("varying", 384, 32, "varying-384:32")
    assert spec.clients == () and rollout_workloads.run_spec("grpo-1024:16@bare").clients == ("bare",)
    for bad in ("grpo:32", "grpo-128", "tree-1:2", "grpo-x:2", "grpo-1:2@curl"):
        with pytest.raises(argparse.ArgumentTypeError):
            rollout_workloads.run_spec(bad)


def test_a_flag_added_to_the_backends_is_its_own_variant() -> None:
    """r39-lora-* change one SGLang flag of the backend's launch: their results must not pool with (and
    replace) r39-direct-exact's, whose key differs only in the variant."""
    direct = ["--side", "direct", "--engine", "sglang", "--model", "m", "--flags", "backend",
              "--request-form", "gateway"]  # fmt: skip
    exact = rollout_options.variant(rollout_options.parse_arguments(None, direct))
    changed = rollout_options.variant(
        rollout_options.parse_arguments(None, [*direct, "--sglang-args=--lora-backend triton"])
    )
    assert exact == "lora, backend flags, gateway form"
    assert changed == "lora, backend flags, --lora-backend triton, gateway form"
    # The triton path asked for by name is the default (r39-backend-triton pools with r39-backend-a1); the
    # kernels SGLang chose before it, csgmv, and triton off the path are variants of their own.
    triton = ["--lora-backend", "triton", "--lora-experimental-path"]
    assert rollout_options.variant(rollout_options.parse_arguments(None, [*direct, *triton])) == exact
    backend = ["--side", "backend", "--model", "m"]
    assert rollout_options.variant(rollout_options.parse_arguments(None, [*backend, *triton])) == "lora"
    for kernels, words in [
        (["--lora-backend", "csgmv"], "csgmv no experimental path"),
        (["--lora-backend", "triton", "--no-lora-experimental-path"], "triton no experimental path"),
    ]:
        assert rollout_options.variant(rollout_options.parse_arguments(None, [*backend, *kernels])) == (
            f"lora, --lora-backend {words}"
        )


def test_backports_other_than_the_defaults_are_a_variant_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """suite.sh's BACKPORTS_WITH / r39-drop-* run the same suite with other backports than the defaults: their
    results must not pool with the default server's."""
    backend = ["--side", "backend", "--model", "m"]
    monkeypatch.setenv("ART_SGLANG_BACKPORTS", "default")
    assert rollout_options.variant(rollout_options.parse_arguments(None, backend)) == "lora"
    monkeypatch.setenv(
        "ART_SGLANG_BACKPORTS", rollout_options.backports.without("logprob-json,chat-convert-thread")
    )
    assert rollout_options.variant(rollout_options.parse_arguments(None, backend)) == (
        "lora, backports -chat-convert-thread -logprob-json"
    )
    vllm = ["--side", "direct", "--engine", "vllm", "--model", "m"]
    assert rollout_options.variant(rollout_options.parse_arguments(None, vllm)) == "lora"  # not SGLang's


def test_server_info_is_kept_without_its_keys() -> None:
    info = {"api_key": "k1", "admin_api_key": None, "cuda_graph_max_bs": 256,
            "internal_states": [{"api_key": "k2", "memory_usage": {"kvcache": 9.5}}]}  # fmt: skip
    assert rollout_targets.scrubbed(info) == {"api_key": "<set>", "admin_api_key": None, "cuda_graph_max_bs": 256,
                                              "internal_states": [{"api_key": "<set>", "memory_usage": {"kvcache": 9.5}}]}  # fmt: skip


def test_the_launch_record_names_the_backports_sglang_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inherited from the bench's environment (suite.sh's BACKPORTS_WITH) the choice is in no added variable,
    so the record names it; the reference engine loads no backports."""
    from art_sglang.config import SGLangConfig
    from art_sglang.serving.servers.process import ServerProcess

    monkeypatch.setenv("ART_SGLANG_BACKPORTS", "json-response,triton-prefill-grid")
    sglang = ServerProcess(SGLangConfig(port=30001), "m", engine="sglang", log_path=tmp_path / "s.log")
    assert rollout_targets.launch_record(sglang)["backports"] == ["json-response", "triton-prefill-grid"]
    monkeypatch.delenv("ART_SGLANG_BACKPORTS")
    defaults = rollout_targets.art_sglang_backports.selection(None)
    assert rollout_targets.launch_record(sglang)["backports"] == defaults
    assert defaults != ["json-response", "triton-prefill-grid"]  # the two choices differ
    # The triton path's variables are in the environment the record names, only where it runs (a plan, or
    # bench_common's sglang_config, settles an unset lora_experimental_path; unsettled it does not run).
    assert "SGLANG_EXPERIMENTAL_LORA_OPTI" not in rollout_targets.launch_record(sglang)["environment"]
    settled = SGLangConfig(port=30001, lora_experimental_path=True)
    on = ServerProcess(settled, "m", engine="sglang", log_path=tmp_path / "t.log")
    assert rollout_targets.launch_record(on)["environment"]["SGLANG_EXPERIMENTAL_LORA_OPTI"] == "1"
    reference = ServerProcess(SGLangConfig(port=30001), "m", engine="reference", log_path=tmp_path / "r.log")
    assert "backports" not in rollout_targets.launch_record(reference)


def test_sglang_cache_counters_from_prometheus_text() -> None:
    metrics = "\n".join([
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{model_name="/m",tp_rank="0"} 1000.0',
        'sglang:prompt_tokens_total{model_name="/m",tp_rank="1"} 500.0',
        'sglang:cached_tokens_total{model_name="/m"} 900.0',
        "sglang:cache_hit_rate 0.6",
    ])  # fmt: skip
    assert rollout_targets.parse_sglang_cache_counters(metrics) == {"prompt": 1500.0, "cached": 900.0}
    assert rollout_targets.parse_sglang_cache_counters("sglang:num_running_reqs 3.0") is None
    # The radix cache's evictions: 5 calls, 2 of them 0.1 s or longer (the histogram's buckets are cumulative).
    label = 'cache_type="RadixCache"'
    evictions = "\n".join([
        metrics,
        f"sglang:evicted_tokens_total{{{label}}} 40960.0",
        f"sglang:evicted_tokens_created{{{label}}} 1764310000.0",
        f'sglang:eviction_duration_seconds_bucket{{{label},le="0.05"}} 3.0',
        f'sglang:eviction_duration_seconds_bucket{{{label},le="0.1"}} 3.0',
        f'sglang:eviction_duration_seconds_bucket{{{label},le="0.5"}} 4.0',
        f'sglang:eviction_duration_seconds_bucket{{{label},le="+Inf"}} 5.0',
        f"sglang:eviction_duration_seconds_count{{{label}}} 5.0",
        f"sglang:eviction_duration_seconds_sum{{{label}}} 1.25",
    ])  # fmt: skip
    assert rollout_targets.parse_sglang_cache_counters(evictions) == {
        "prompt": 1500.0, "cached": 900.0, "evicted_tokens": 40960.0, "evictions": 5.0, "eviction_s": 1.25,
        "slow_evictions": 2.0,
    }  # fmt: skip


async def test_a_silenced_watchdog_never_probes() -> None:
    """--no-watchdog: a backend's watchdog started inside `watchdog_silenced` does not probe its server
    (it calls `recover` once its interval has passed, as it does once the block is left)."""
    from art_sglang.serving.servers.watchdog import WATCHDOG_INTERVAL_S, ServerWatchdog

    class Servers:
        probes = 0

        async def recover(self) -> bool:
            self.probes += 1
            return False

    for silent in (True, False):
        servers = Servers()
        async with rollout_targets.watchdog_silenced(silent):
            watchdog = ServerWatchdog(servers)  # type: ignore[arg-type]
            watchdog.ensure_running()
            await asyncio.sleep(WATCHDOG_INTERVAL_S + 0.5)
            await watchdog.stop()
        assert (servers.probes == 0) is silent


def test_the_eos_bias_gives_the_mean_length(tiny_model_path: Path) -> None:
    from transformers import AutoConfig

    bias = bench_rollouts.eos_bias(str(tiny_model_path), 128)
    vocab, eos = AutoConfig.from_pretrained(tiny_model_path).vocab_size, len(bias)
    # With equal logits elsewhere, the chance of ending at each token is 1 / 128.
    weight = eos * math.exp(next(iter(bias.values())))
    assert weight / (vocab - eos + weight) == pytest.approx(1 / 128, rel=1e-2)


def bench(*args: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_rollouts.py"), *args, "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def as_vllm(
    document: dict[str, Any], variant: str, path: Path, speed: float = 2.0, route: str = "server"
) -> dict[str, Any]:
    """A vLLM result (`variant` "lora" or "base") of the work `document` measured on `route`, `speed` times
    as fast, written to `path`."""
    vllm = copy.deepcopy(document)
    vllm.update(side="direct", engine="vllm", variant=variant)
    vllm["results"] = [e for e in vllm["results"] if e["route"] == route]
    for entry in vllm["results"]:
        entry.update(side="direct", engine="vllm", variant=variant, route="server", merging=None)
        for r in entry["runs"]:
            r["output_tokens_per_s"] *= speed
        entry["median"]["output_tokens_per_s"] *= speed
    path.write_text(json.dumps(vllm))
    return vllm


def test_end_to_end_through_the_backend_on_cpu(tmp_path: Path, tiny_model_path: Path) -> None:
    common = ["--engine", "reference", "--model", str(tiny_model_path), "--group-size", "2", "--turns", "2",
              "--prompt-tokens", "32", "--min-seconds", "0", "--repeats", "1"]  # fmt: skip
    out = tmp_path / "backend.json"
    bench("--side", "backend", *common, "--runs", "grpo-2:2", "multiturn-2:1@bare", "--off-kinds", "grpo",
          "--routes", "gateway", "server", "--label", "A1", "--ttft-requests", "1", "--json", str(out),
          "--markdown", str(tmp_path / "backend.md"), tmp_path=tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["side"] == "backend" and result["device"] == "CPU" and result["start_s"] > 0
    assert result["label"] == "A1" and set(result["clients"]) == {"art", "bare"}
    assert result["machine"]["cpu_count"] and result["versions"]["torch"]
    assert result["model_description"]["vocab_size"] == 2048  # the CPU suite's tiny model
    # The server's launch as the backend made it: keys in a file its command line names, never on it.
    assert "--config" in result["launch"]["command"] and "--api-key" not in result["launch"]["command"]
    assert result["launch"]["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert result["server_info"]["api_key"] == "<set>" and result["server_info"]["enable_metrics"] is True
    assert result["watchdog"] is True and result["trainer_cpu_s"] >= 0
    configurations = {(e["run"], e["route"], e["merging"], e["client"]) for e in result["results"]}
    # Through the gateway grpo runs with prefill sharing on and off (--off-kinds grpo), multi-turn on only.
    gateway = {("grpo-2:2", "gateway", m, c) for m in ("on", "off") for c in ("art", "bare")}
    server = {("grpo-2:2", "server", None, c) for c in ("art", "bare")}
    multiturn = {("multiturn-2:1", "gateway", "on", "bare"), ("multiturn-2:1", "server", None, "bare")}
    assert configurations == gateway | server | multiturn
    for entry in result["results"]:
        run = entry["runs"][0]
        assert run["requests"] == 4 and run["mean_completion_tokens"] == 2
    # The reference engine caches a group's shared prompt; its /metrics agree with the usage reports.
    plain = next(
        e for e in result["results"] if (e["route"], e["merging"], e["client"]) == ("server", None, "bare")
    )
    assert (
        0
        < plain["runs"][0]["cached_share"]
        == pytest.approx(plain["runs"][0]["server_cached_share"], rel=0.05)
    )

    # SGLang (here the reference engine) launched directly exactly as the backend launched it, one suspect
    # dropped, requests in the gateway's form.
    direct = tmp_path / "direct.json"
    bench("--side", "direct", *common, "--runs", "grpo-2:2@bare", "--flags", "backend", "--drop", "metrics",
          "--request-form", "gateway", "--ttft-requests", "0", "--json", str(direct), tmp_path=tmp_path)  # fmt: skip
    exact = json.loads(direct.read_text())
    assert exact["variant"] == "lora, backend flags -metrics, gateway form"
    theirs, mine = result["sglang_config"], exact["sglang_config"]
    assert {k for k in theirs if theirs[k] != mine.get(k)} <= {"enable_metrics", "port"}
    assert theirs["enable_metrics"] and not mine["enable_metrics"]
    assert "--config" in exact["launch"]["command"]
    assert [e["runs"][0]["requests"] for e in exact["results"]] == [4]

    # A vLLM result of the same work (made from the direct one), compared: the ratios are backend / vLLM.
    vllm = as_vllm(exact, "lora", tmp_path / "vllm.json")
    # The backend in another configuration (a label that is not a pass of the A/B/A order), 3 times as fast.
    other = copy.deepcopy(result)
    other["label"] = "triton"
    for entry in other["results"]:
        entry["label"] = "triton"
        for r in entry["runs"]:
            r["output_tokens_per_s"] *= 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    # ... and in a configuration that only its variant tells apart (other backports), twice as fast.
    backports = copy.deepcopy(result)
    backports["variant"] = "lora, backports +chat-convert-thread"
    for entry in backports["results"]:
        entry["variant"] = backports["variant"]
        for r in entry["runs"]:
            r["output_tokens_per_s"] *= 2
    (tmp_path / "backports.json").write_text(json.dumps(backports))
    compared = tmp_path / "both.json"
    bench_rollouts.main(["--compare", str(out), str(direct), str(tmp_path / "vllm.json"), str(tmp_path / "other.json"),
                         str(tmp_path / "backports.json"), "--json", str(compared), "--markdown",
                         str(tmp_path / "both.md")])  # fmt: skip
    document = json.loads(compared.read_text())
    assert document["one_machine"] is None and len(document["sources"]) == 5  # no GPU: no UUID to compare
    ratios = {(r["backend"], r["to"], r["client"]): r for r in document["ratios"] if r["run"] == "grpo-2:2"}
    mine_rate = next(
        e["median"]["output_tokens_per_s"]
        for e in result["results"]
        if (e["run"], e["route"], e["merging"], e["client"]) == ("grpo-2:2", "gateway", "on", "bare")
    )
    vllm_rate = vllm["results"][0]["median"]["output_tokens_per_s"]
    assert ratios["backend A1", "vLLM+LoRA", "bare"]["output_tokens_per_s"] == pytest.approx(
        mine_rate / vllm_rate
    )
    assert (
        "backend's server, no gateway A1",
        "SGLang direct+LoRA, backend flags -metrics, gateway form",
        "bare",
    ) in {(b, t.replace("reference direct", "SGLang direct"), c) for b, t, c in ratios}
    assert set(document["lone_requests"]) == {
        "backend reference lora A1",
        "backend reference lora triton",
        "backend reference lora, backports +chat-convert-thread A1",
    }
    lines = (tmp_path / "both.md").read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| workload |"))
    assert "backend / vLLM+LoRA, bare" in lines[start] and "vLLM+LoRA · bare" in lines[start]
    assert [line.split(" | ")[0] for line in lines[start + 2 : start + 4]] == [
        "| grpo-2:2",
        "| multiturn-2:1",
    ]
    # The labelled configuration keeps its own column and ratio; the pass A1 alone makes the backend's.
    headers = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert len(set(headers)) == len(headers)
    row = dict(zip(headers, (cell.strip() for cell in lines[start + 2].strip("|").split("|")), strict=True))
    assert (
        f"{mine_rate:,.0f} " in row["backend · bare"]
        and f"{3 * mine_rate:,.0f} " in row["backend triton · bare"]
        and f"{2 * mine_rate:,.0f} " in row["backend, backports +chat-convert-thread · bare"]
    )
    default, labelled, other_backports = (
        float(row[f"{name} / vLLM+LoRA, bare"].split("**")[1])
        for name in ("backend", "backend triton", "backend, backports +chat-convert-thread")
    )
    assert labelled == pytest.approx(3 * default, abs=0.05)  # each shown to 2 decimals
    assert other_backports == pytest.approx(2 * default, abs=0.05)


def test_a_direct_server_beside_an_idle_trainer_on_cpu(tmp_path: Path, tiny_model_path: Path) -> None:
    """--beside-trainer: the backend's trainer worker starts with the direct server (step 0: a fresh
    adapter), stays idle through the runs (its CPU seconds reported) and is stopped with the server."""
    out = tmp_path / "direct.json"
    bench("--side", "direct", "--engine", "reference", "--model", str(tiny_model_path), "--flags", "backend",
          "--request-form", "gateway", "--beside-trainer", "--group-size", "2", "--prompt-tokens", "32",
          "--min-seconds", "0", "--repeats", "1", "--runs", "grpo-2:2@bare", "--ttft-requests", "0",
          "--json", str(out), tmp_path=tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variant"] == "lora, backend flags, gateway form, beside an idle trainer"
    trainer = result["beside_trainer"]
    assert trainer["step"] == 0 and trainer["resumed"] is False and trainer["device"] == "cpu"
    assert result["trainer_cpu_s"] >= 0 and not psutil.pid_exists(trainer["pid"])
    assert (tmp_path / "work" / "beside-trainer" / "0000").is_dir()
    assert [e["runs"][0]["requests"] for e in result["results"]] == [4]


def test_the_backend_in_merged_mode_on_cpu(tmp_path: Path, tiny_model_path: Path) -> None:
    """`--weights merged`: the server starts without LoRA, a step is trained and its merged weights pushed
    before anything is measured, through the gateway and straight to the server (by the base id); compared,
    the merged backend is its own column with its ratios to vLLM+LoRA and vLLM's base weights."""
    out = tmp_path / "merged.json"
    bench("--side", "backend", "--weights", "merged", "--engine", "reference", "--model", str(tiny_model_path),
          "--group-size", "2", "--prompt-tokens", "32", "--min-seconds", "0", "--repeats", "1", "--runs",
          "grpo-2:2", "--routes", "gateway", "server", "--ttft-requests", "0", "--json", str(out),
          tmp_path=tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variant"] == result["weights"] == "merged"
    assert result["sglang_config"]["weight_sync_method"] == "merged"
    assert not [arg for arg in result["launch"]["command"] if "lora" in arg]  # no LoRA kernels
    assert result["served_step"] == 1 and [s["step"] for s in result["trained_steps"]] == [1]
    assert "time/sync_s" in result["trained_steps"][0]["metrics"]
    rates = {(e["route"], e["client"]): e["median"]["output_tokens_per_s"] for e in result["results"]}
    assert set(rates) == {(route, c) for route in ("gateway", "server") for c in ("art", "bare")}
    assert all(rate > 0 for rate in rates.values()) and all(
        e["variant"] == "merged" for e in result["results"]
    )
    assert all(e["runs"][0]["requests"] == 4 for e in result["results"])

    # A LoRA backend's result needs a different --json: --resume refuses to pool the two.
    with pytest.raises(SystemExit, match="another side, variant"):
        bench_rollouts.main(["--side", "backend", "--engine", "reference", "--model", str(tiny_model_path),
                             "--resume", "--json", str(out), "--workdir", str(tmp_path / "work")])  # fmt: skip

    lora, base = tmp_path / "vllm-lora.json", tmp_path / "vllm-base.json"
    as_vllm(result, "lora", lora, speed=2.0, route="gateway")
    as_vllm(result, "base", base, speed=4.0, route="gateway")
    compared = tmp_path / "both.json"
    bench_rollouts.main(["--compare", str(out), str(lora), str(base), "--json", str(compared),
                         "--markdown", str(tmp_path / "both.md")])  # fmt: skip
    ratios = {
        (r["backend"], r["to"], r["client"]): r["output_tokens_per_s"]
        for r in json.loads(compared.read_text())["ratios"]
    }
    assert ratios["backend, merged", "vLLM+LoRA", "bare"] == pytest.approx(0.5)
    assert ratios["backend, merged", "vLLM base", "art"] == pytest.approx(0.25)
    lines = (tmp_path / "both.md").read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| workload |"))
    headers = [cell.strip() for cell in lines[start].strip("|").split("|")]
    row = dict(zip(headers, (cell.strip() for cell in lines[start + 2].strip("|").split("|")), strict=True))
    assert row["workload"] == "grpo-2:2" and row["backend, merged · bare"] != "—"
    assert row["backend, merged / vLLM+LoRA, bare"].startswith("**0.50**")
    assert row["backend, merged / vLLM base, bare"].startswith("**0.25**")
    assert row["backend, merged / vLLM+LoRA, ART's client"].startswith("**0.50**")
