"""scripts/benchmark_inference.py on CPU (the reference engine, tiny model, prefix cache on and off), the
comparison of scripts/bench_engines.py on its results, and the vLLM side of scripts/inference_engines.py
that cannot run here: its command line, its adapter routes and its metrics parsing."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_sglang.config import DEFAULT_LORA_TARGETS

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_engines  # noqa: E402
from bench_common import ServerSettings  # noqa: E402
from inference_engines import (  # noqa: E402
    VLLM_PYTHON_ENV,
    EngineServer,
    VLLMProcess,
    parse_prefix_cache_counters,
    vllm_args,
)

SIZES = {"groups": 2, "group_size": 3, "conversations": 2, "turns": 3, "max_tokens": 4, "prefix_tokens": 64}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("inference")
    sizes = [arg for key, value in SIZES.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark_inference.py"), "--engine", "reference",
         "--model", str(tiny_model_path), "--concurrency", "3", "--prefix-cache", "on", "off",
         "--hot-loads", "2", *sizes, "--workdir", str(out / "work"), "--json", str(out / "run.json"),
         "--markdown", str(out / "run.md")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {"json": out / "run.json", "result": json.loads((out / "run.json").read_text()),
            "table": (out / "run.md").read_text()}  # fmt: skip


def test_each_workload_reports_its_cache_hits(reference_run: dict[str, Any]) -> None:
    result = reference_run["result"]
    assert result["engine"] == "reference" and result["device"] == "CPU"
    assert [run["prefix_cache"] for run in result["runs"]] == [True, False]
    expected_requests = {"grpo": 6, "unique": 6, "multiturn": 6}
    for run in result["runs"]:
        assert run["start_s"] > 0 and ("--disable-radix-cache" in run["command"]) != run["prefix_cache"]
        by_workload = {r["workload"]: r for r in run["results"]}
        assert set(by_workload) == set(expected_requests)
        for name, r in by_workload.items():
            assert r["requests"] == expected_requests[name] and r["concurrency"] == 3
            # ignore_eos: every request generates exactly max_tokens
            assert r["output_tokens_per_s"] * r["wall_s"] == pytest.approx(r["requests"] * 4)
            assert 0 < r["ttft_median_s"] <= r["latency_median_s"] <= r["latency_p99_s"]
            assert r["mean_prompt_tokens"] >= 64
        cached = {name: r["cached_share"] for name, r in by_workload.items()}
        if run["prefix_cache"]:
            # A group's later rollouts and a conversation's later turns find their prefix cached; the
            # control shares only the chat template's first tokens.
            assert cached["grpo"] > 0.3 and cached["multiturn"] > 0.3 and cached["unique"] < 0.1
        else:
            assert cached == {"grpo": 0.0, "multiturn": 0.0, "unique": 0.0}
        assert len(run["hot_load"]) == 2
        assert all(t["load_s"] > 0 and t["first_answer_s"] > 0 for t in run["hot_load"])
    rows = [line for line in reference_run["table"].splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6 and "adapter hot-load" in reference_run["table"]


def _as_vllm(result: dict[str, Any], speed: float) -> dict[str, Any]:
    """The same document as another engine's, `speed` times the throughput and 1/speed the latencies."""
    other = copy.deepcopy(result)
    other["engine"] = "vllm"
    for run in other["runs"]:
        for r in run["results"]:
            r["output_tokens_per_s"] *= speed
            for key in ("ttft_median_s", "ttft_p99_s", "latency_median_s", "latency_p99_s"):
                r[key] /= speed
    return other


def test_bench_engines_compares_the_cached_runs(reference_run: dict[str, Any], tmp_path: Path) -> None:
    sglang = reference_run["result"]
    vllm_path = tmp_path / "vllm.json"
    vllm_path.write_text(json.dumps(_as_vllm(sglang, 2.0)))
    out = tmp_path / "engines.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_engines.py"), "--model", sglang["model"],
         "--reuse", f"sglang={reference_run['json']}", "--reuse", f"vllm={vllm_path}",
         "--workdir", str(tmp_path / "work"), "--json", str(out), "--markdown", str(tmp_path / "e.md")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "work").exists()  # nothing was run: both results were reused
    document = json.loads(out.read_text())
    rows = document["ratios"]["workloads"]
    assert {(r["workload"], r["concurrency"]) for r in rows} == {("grpo", 3), ("multiturn", 3), ("unique", 3)}
    for r in rows:
        assert r["output_tokens_per_s"]["ratio"] == pytest.approx(0.5)
        assert r["ttft_median_s"]["ratio"] == pytest.approx(2.0)
        assert r["cached_share"]["sglang"] == r["cached_share"]["vllm"] > 0 or r["workload"] == "unique"
    assert document["ratios"]["hot_load_total_s"]["ratio"] == pytest.approx(1.0)
    assert document["engines"]["vllm"]["engine"] == "vllm"
    assert (tmp_path / "e.md").read_text().count("\n| ") == 1 + 3


def test_bench_engines_refuses_results_of_different_work(reference_run: dict[str, Any]) -> None:
    sglang = reference_run["result"]
    other = _as_vllm(sglang, 1.0)
    other["max_tokens"] = 8
    with pytest.raises(SystemExit, match="max_tokens"):
        bench_engines.compare({"sglang": sglang, "vllm": other})


def test_vllm_command_line() -> None:
    settings = ServerSettings(model="/m", mem_fraction=0.4, max_lora_rank=16, attention_backend="FLASH_ATTN")
    args = vllm_args(settings, host="127.0.0.1", port=8123)

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert (
        value("--model") == "/m" and value("--port") == "8123" and value("--gpu-memory-utilization") == "0.4"
    )
    assert value("--max-lora-rank") == "16" and value("--max-loras") == "4"
    assert {"--enable-lora", "--enable-prompt-tokens-details", "--enable-prefix-caching"} <= set(args)
    assert value("--attention-backend") == "FLASH_ATTN" and "--enforce-eager" not in args
    off = vllm_args(ServerSettings(model="/m", prefix_cache=False, cuda_graph=False), host="h", port=1)
    assert (
        "--no-enable-prefix-caching" in off
        and "--enforce-eager" in off
        and "--enable-prefix-caching" not in off
    )
    with pytest.raises(ValueError, match="sampling-backend"):
        vllm_args(ServerSettings(model="/m", sampling_backend="pytorch"), host="h", port=1)
    with pytest.raises(ValueError, match="max-lora-rank"):
        vllm_args(ServerSettings(model="/m", max_lora_rank=12), host="h", port=1)
    with pytest.raises(ValueError, match="sglang-args"):
        vllm_args(ServerSettings(model="/m", sglang_args=("--schedule-policy", "lpm")), host="h", port=1)
    with pytest.raises(ValueError, match="lora-target-modules"):
        vllm_args(ServerSettings(model="/m", lora_target_modules=("q_proj",)), host="h", port=1)
    with pytest.raises(ValueError, match="lora-experimental-path are SGLang's"):
        vllm_args(ServerSettings(model="/m", lora_backend="csgmv"), host="h", port=1)


def test_sglang_command_line_carries_the_further_flags() -> None:
    from bench_common import add_server_args, server_settings, sglang_config

    def launch(settings: ServerSettings) -> list[str]:
        return sglang_config(settings).server_args(settings.model, 1)

    parser = argparse.ArgumentParser()
    add_server_args(parser, engines=("sglang",))
    args = parser.parse_args(
        ["--model", "/m", "--sglang-args=--schedule-policy lpm --tokenizer-worker-num 4"]
    )
    tuned = launch(server_settings(args))
    assert tuned[-4:] == ["--schedule-policy", "lpm", "--tokenizer-worker-num", "4"]
    assert "--schedule-policy" not in launch(ServerSettings(model="/m"))
    # SGLangConfig's LoRA kernels by default (the triton path); SGLang's own on request.
    assert "--lora-backend triton" in " ".join(launch(server_settings(args)))
    assert sglang_config(server_settings(args)).experimental_lora_served
    csgmv = parser.parse_args(["--model", "/m", "--lora-backend", "csgmv"])
    config = sglang_config(server_settings(csgmv))
    assert (config.lora_backend, config.experimental_lora_served) == ("csgmv", False)
    # An adapter narrower than the pool (rank 4 in the benches' pool of at least 8): the path would compute
    # NaN, so it is settled off, as a backend's plan settles it.
    narrow = sglang_config(server_settings(parser.parse_args(["--model", "/m", "--lora-rank", "4"])))
    assert (narrow.max_lora_rank, narrow.lora_backend, narrow.experimental_lora_served) == (
        8,
        "triton",
        False,
    )
    trained = parser.parse_args(["--model", "/m", "--lora-target-modules", "q_proj", "v_proj"])
    every = parser.parse_args(["--model", "/m", "--lora-target-modules", "all"])
    for settings, served in [
        (server_settings(trained), ["q_proj", "v_proj"]),
        (server_settings(every), ["all"]),
        (server_settings(parser.parse_args(["--model", "/m"])), DEFAULT_LORA_TARGETS),
        (ServerSettings(model="/m"), DEFAULT_LORA_TARGETS),
    ]:
        flags = launch(settings)
        at = flags.index("--lora-target-modules")
        assert flags[at + 1 : at + 1 + len(served)] == served


def test_vllm_process_runs_vllm_with_runtime_lora_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    server = EngineServer("vllm", ServerSettings(model="/m"), log_path=tmp_path / "log", port=8123)
    assert isinstance(server.process, VLLMProcess) and server.interpreter() == "/opt/vllm/bin/python"
    assert server.command()[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    env = server.process.environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


@pytest.mark.parametrize(
    ("engine", "load", "unload", "model"),
    [
        ("vllm", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "hot0@0"),
        ("sglang", "/load_lora_adapter", "/unload_lora_adapter", "/m:hot0@0"),
    ],
)
async def test_adapter_routes(engine: str, load: str, unload: str, model: str, tmp_path: Path) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, text="Success")

    server = EngineServer(engine, ServerSettings(model="/m"), log_path=tmp_path / "log", port=8123)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        await server.load_adapter(http, "hot0@0", tmp_path / "adapter")
        await server.unload_adapter(http, "hot0@0")
    assert seen == [
        (load, {"lora_name": "hot0@0", "lora_path": str(tmp_path / "adapter")}),
        (unload, {"lora_name": "hot0@0"}),
    ]
    assert server.adapter_model("hot0@0") == model


async def test_a_refused_adapter_load_is_an_error(tmp_path: Path) -> None:
    server = EngineServer("vllm", ServerSettings(model="/m"), log_path=tmp_path / "log", port=8123)
    transport = httpx.MockTransport(lambda _: httpx.Response(400, text="The lora adapter 'x' was not found"))
    async with httpx.AsyncClient(transport=transport) as http:
        with pytest.raises(RuntimeError, match="400: The lora adapter"):
            await server.load_adapter(http, "x", tmp_path)


def test_vllm_prefix_cache_counters_from_prometheus_text() -> None:
    metrics = "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="/m"} 1200.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="/m"} 800.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="/m"} 1.7e9',
        'vllm:prefix_cache_hits_total{engine="0",model_name="/m"} 900.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="/m"} 5.0',
        "vllm:num_requests_running 3.0",
    ])  # fmt: skip
    assert parse_prefix_cache_counters(metrics) == {"queries": 2000.0, "hits": 900.0}
    assert parse_prefix_cache_counters("") == {"queries": 0.0, "hits": 0.0}


def test_an_adapter_folder_made_for_another_model_is_rebuilt(tmp_path: Path, tiny_model_path: Path) -> None:
    """A workdir shared by runs on two model shapes must not hand the first model's adapter to the second."""
    from bench_common import make_random_adapter
    from safetensors import safe_open

    from art_sglang.tiny_model import build_tiny_model

    wider = build_tiny_model(tmp_path / "wider", hidden=96)

    def widths(adapter: Path) -> set[int]:
        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as tensors:
            names = list(tensors.keys())  # a safetensors file handle is not iterable
            return {tensors.get_slice(k).get_shape()[1] for k in names if "q_proj.lora_A" in k}

    folder = tmp_path / "adapter-0"
    assert widths(make_random_adapter(str(tiny_model_path), folder)) == {64}
    assert widths(make_random_adapter(str(wider), folder)) == {96}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(wider) and config["r"] == 8
    # The same model and rank again: the folder is reused as it is.
    before = (folder / "adapter_model.safetensors").stat().st_mtime_ns
    make_random_adapter(str(wider), folder)
    assert (folder / "adapter_model.safetensors").stat().st_mtime_ns == before
