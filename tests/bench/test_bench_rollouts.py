"""scripts/bench_rollouts.py: its run loop against a fake gateway with a prefill-sharing switch (on and off
alternate, the counters are per run, --resume and --deadline-s), and end to end on CPU through
SGLangBackend on the reference engine, then compared with a vLLM result made from it."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_rollouts  # noqa: E402


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


def fake_target() -> tuple[bench_rollouts.Target, FakeGateway, FakeCompletions]:
    gateway = FakeGateway()
    completions = FakeCompletions(gateway)
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    backend = SimpleNamespace(inference=SimpleNamespace(gateway=gateway))
    return bench_rollouts.Target(client, "m@0", backend=backend), gateway, completions  # type: ignore[arg-type]


def loop_args(tmp_path: Path, **changes: Any) -> argparse.Namespace:
    values = {"side": "backend", "engine": "sglang", "off_kinds": ["grpo", "multiturn"], "repeats": 3, "min_seconds": 0.0,
              "deadline_s": None, "json": tmp_path / "out.json", "group_size": 8, "turns": 3,
              "runs": [bench_rollouts.run_spec("grpo-128:2"), bench_rollouts.run_spec("multiturn-64:1")]}  # fmt: skip
    return argparse.Namespace(**{**values, **changes})


async def test_merging_on_and_off_alternate_on_one_target(tmp_path: Path) -> None:
    target, gateway, completions = fake_target()
    args = loop_args(tmp_path)
    document: dict[str, Any] = {"results": [], "varying_logit_bias": {}}
    await bench_rollouts.measure(target, None, args, document, "body", 0.0)  # type: ignore[arg-type]
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
    # The multiturn conversations resend their history: the third turn carries two answers.
    assert max(len(c["messages"]) for c in completions.calls) == 1 + 3 + 2
    assert json.loads(args.json.read_text())["results"] == document["results"]

    # --resume: what the document holds is not run again; --deadline-s: nothing starts after it.
    calls = len(completions.calls)
    await bench_rollouts.measure(target, None, args, document, "body", 0.0)  # type: ignore[arg-type]
    assert len(completions.calls) == calls
    late = loop_args(tmp_path, deadline_s=1.0, runs=[bench_rollouts.run_spec("varying-384:1")])
    await bench_rollouts.measure(target, None, late, document, "body", -10.0)  # type: ignore[arg-type]
    assert len(completions.calls) == calls and len(document["results"]) == 4

    # varying: no ignore_eos, the end-of-sequence bias of its length instead.
    varying = loop_args(tmp_path, repeats=1, runs=[bench_rollouts.run_spec("varying-384:1")])
    document["varying_logit_bias"] = {"384": {"2": 3.5}}
    await bench_rollouts.measure(target, None, varying, document, "body", 0.0)  # type: ignore[arg-type]
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


def test_a_gateway_without_a_switch_runs_one_setting() -> None:
    target = bench_rollouts.Target(
        None, "m", backend=SimpleNamespace(inference=SimpleNamespace(gateway=object()))
    )  # type: ignore[arg-type]
    assert target.merge_settings(["on", "off"]) == [None] and target.merge_counters() is None
    assert bench_rollouts.Target(None, "m").merge_settings(["on", "off"]) == [None]  # type: ignore[arg-type]


def test_run_specs() -> None:
    spec = bench_rollouts.run_spec("varying-384:32")
    assert (spec.kind, spec.tokens, spec.groups, spec.name) == ("varying", 384, 32, "varying-384:32")
    for bad in ("grpo:32", "grpo-128", "tree-1:2", "grpo-x:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_rollouts.run_spec(bad)


def test_sglang_cache_counters_from_prometheus_text() -> None:
    metrics = "\n".join([
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{model_name="/m",tp_rank="0"} 1000.0',
        'sglang:prompt_tokens_total{model_name="/m",tp_rank="1"} 500.0',
        'sglang:cached_tokens_total{model_name="/m"} 900.0',
        "sglang:cache_hit_rate 0.6",
    ])  # fmt: skip
    assert bench_rollouts.parse_sglang_cache_counters(metrics) == {"prompt": 1500.0, "cached": 900.0}
    assert bench_rollouts.parse_sglang_cache_counters("sglang:num_running_reqs 3.0") is None


def test_the_eos_bias_gives_the_mean_length(tiny_model_path: Path) -> None:
    from transformers import AutoConfig

    bias = bench_rollouts.eos_bias(str(tiny_model_path), 128)
    vocab, eos = AutoConfig.from_pretrained(tiny_model_path).vocab_size, len(bias)
    # With equal logits elsewhere, the chance of ending at each token is 1 / 128.
    weight = eos * math.exp(next(iter(bias.values())))
    assert weight / (vocab - eos + weight) == pytest.approx(1 / 128, rel=1e-2)


def test_end_to_end_through_the_backend_on_cpu(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "backend.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_rollouts.py"), "--side", "backend", "--engine", "reference",
         "--model", str(tiny_model_path), "--runs", "grpo-2:2", "multiturn-2:1", "--off-kinds", "grpo", "multiturn",
         "--group-size", "2", "--turns", "2", "--prompt-tokens", "32", "--min-seconds", "0",
         "--repeats", "1", "--ttft-requests", "1", "--workdir", str(tmp_path / "work"), "--json", str(out),
         "--markdown", str(tmp_path / "backend.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["side"] == "backend" and result["device"] == "CPU" and result["start_s"] > 0
    assert result["client"].startswith("ART's")
    runs = {e["run"]: e for e in result["results"] if e["merging"] != "on"}  # as forwarded one by one
    assert set(runs) == {"grpo-2:2", "multiturn-2:1"}
    grpo = runs["grpo-2:2"]["runs"][0]
    assert grpo["requests"] == 4 and grpo["mean_completion_tokens"] == 2
    # The reference engine caches a group's shared prompt; its /metrics agree with the usage reports.
    assert 0 < grpo["cached_share"] == pytest.approx(grpo["server_cached_share"], rel=0.05)
    assert runs["multiturn-2:1"]["runs"][0]["requests"] == 4
    # One setting while the gateway has no prefill-sharing switch, else on and off (each run, each lone request).
    settings = {e["merging"] for e in result["results"]}
    assert (settings, set(result["lone_requests"])) in (({None}, {"-"}), ({"on", "off"}, {"on", "off"}))

    # A vLLM result of the same work (made from this one), compared: the ratios are backend / vLLM.
    vllm = copy.deepcopy(result)
    vllm.update(side="direct", engine="vllm")
    vllm["results"] = [e for e in vllm["results"] if e["merging"] != "on"]  # vLLM has no merge switch
    for entry in vllm["results"]:
        entry.update(side="direct", engine="vllm", merging=None)
        entry["median"]["output_tokens_per_s"] *= 2
    vllm_rate = {e["run"]: e["median"]["output_tokens_per_s"] for e in vllm["results"]}
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    compared = tmp_path / "both.json"
    bench_rollouts.main(["--compare", str(out), str(tmp_path / "vllm.json"), "--json", str(compared),
                         "--markdown", str(tmp_path / "both.md")])  # fmt: skip
    document = json.loads(compared.read_text())
    assert {(r["run"], r["merging"]) for r in document["ratios_to_vllm"]} == {
        (e["run"], e["merging"]) for e in result["results"]
    }
    rates = {(e["run"], e["merging"]): e["median"]["output_tokens_per_s"] for e in result["results"]}
    for ratio in document["ratios_to_vllm"]:
        expected = rates[ratio["run"], ratio["merging"]] / vllm_rate[ratio["run"]]
        assert ratio["output_tokens_per_s"] == pytest.approx(expected)
    assert set(document["lone_requests"]) == {"backend reference", "direct vllm"}
    rows = [line for line in (tmp_path / "both.md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(result["results"]) + 2  # the backend's rows and vLLM's
