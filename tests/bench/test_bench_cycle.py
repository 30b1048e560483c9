"""scripts/bench_cycle.py end to end on CPU: the reference engine and the tiny model in a forced shared
layout, one GRPO step per strategy through SGLangBackend.train(), and the JSON and table it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_cycle  # noqa: E402
from bench_common import training_bench_parser  # noqa: E402


@pytest.mark.parametrize("strategy", bench_cycle.STRATEGIES)
def test_each_strategy_builds_its_backend(strategy: str, tmp_path: Path) -> None:
    # The script's own command line, so the test's arguments are never missing one the script reads.
    args = training_bench_parser(None).parse_args(
        ["--engine", "reference", "--model", "/m", "--no-cuda-graph", "--no-prefill-cuda-graph",
         "--lora-target-modules", "all"]
    )  # fmt: skip
    backend = bench_cycle.make_backend(args, strategy, tmp_path / ".art")
    handoff, _, release = strategy.partition("/")
    assert backend.layout.mode == "shared" and backend.handoff_strategy == handoff
    assert backend.trainer_config.lora_rank == 16 and backend.sglang_config.max_lora_rank == 16
    if release:
        assert backend.sglang_config.sleep_release == release
    assert backend.sglang_config.disable_prefill_cuda_graph


def test_a_server_start_is_split_into_sglangs_own_phases() -> None:
    # Lines as SGLang 0.5.17 writes them; the second start (a restart, no prefill graphs) is the one reported.
    log = """[2026-11-23 20:00:01] server_args=ServerArgs(model_path='/m')
[2026-11-23 20:00:09 TP0] Load weight end. elapsed=3.52 s, type=Qwen2ForCausalLM, avail mem=130.1 GB.
[2026-11-23 20:00:30 TP0] Capture target decode cuda graph end. elapsed=20.10 s, mem usage=1.2 GB.
[2026-11-23 20:01:30 TP0] Capture target prefill CUDA graph end. elapsed=60.00 s, mem usage=0.4 GB.
[2026-11-23 20:01:40] The server is fired up and ready to roll!
[2026-11-23 20:05:00] server_args=ServerArgs(model_path='/m')
[2026-11-23 20:05:04.250 TP0] Load weight end. elapsed=2.00 s, type=Qwen2ForCausalLM, avail mem=130.1 GB.
[2026-11-23 20:05:20 TP0] Capture target decode cuda graph end. elapsed=15.50 s, mem usage=1.2 GB.
[2026-11-23 20:05:31] The server is fired up and ready to roll!
"""
    assert bench_cycle.startup_phases(log) == {
        "load_weights_s": 2.0,
        "decode_cuda_graphs_s": 15.5,
        "logged_s": 31.0,
    }
    assert bench_cycle.startup_phases("no server started") == {}


def test_one_step_per_strategy_through_the_backend(tmp_path: Path, tiny_model_path: Path) -> None:
    out, table = tmp_path / "cycle.json", tmp_path / "cycle.md"
    strategies = ["sleep/kv_cache", "restart"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_cycle.py"), "--engine", "reference",
         "--model", str(tiny_model_path), "--strategies", *strategies, "--steps", "1", "--restart-steps",
         "1", "--groups", "2", "--group-size", "3", "--max-tokens", "6",
         "--learning-rate", "0.05", "--workdir", str(tmp_path / "work"), "--json", str(out),
         "--markdown", str(table)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "CPU" and result["engine"] == "reference"
    assert result["versions"]["torch"] and result["workload"]["group_size"] == 3
    assert list(result["strategies"]) == strategies
    for name, s in result["strategies"].items():
        assert s["steps"] == 1 and s["step_reached"] == [1], name
        (overhead,), (train,), (step,) = s["overhead_s"], s["train_s"], s["step_s"]
        assert 0 < overhead < step and 0 < train < step and overhead + train == pytest.approx(step)
        assert s["gpu_release_s"][0] >= 0 and s["gpu_resume_s"][0] >= 0 and s["sync_s"][0] >= 0
        assert s["register_s"] > 0 and s["close_s"] > 0
        # The reference engine logs SGLang's "fired up" line, none of its start phases.
        assert set(s["register_profile"]) == {"logged_s"} and s["register_profile"]["logged_s"] >= 0
        assert s["adapter_kept_after_step"] == [True]
        assert s["adapter_logprob_mean_abs_difference"][0] <= 0.01
        assert s["gpu_mib_server_while_training"] == [None]  # no nvidia-smi here
    assert result["strategies"]["sleep/kv_cache"]["sglang_config"]["sleep_release"] == "kv_cache"
    assert result["strategies"]["sleep/kv_cache"]["sglang_config"]["enable_memory_saver"] is True
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [f"| {s}" for s in strategies]


async def test_the_handoff_check_tells_the_same_adapter_from_another(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """What a broken handoff serves (another adapter under the name, or the base weights) fails the check;
    the same adapter asked again passes it."""
    from contract.contract_helpers import make_adapter

    from art_sglang import SGLangConfig
    from art_sglang.serving.servers.client import ServerClient
    from art_sglang.serving.servers.process import ServerProcess

    model = str(tiny_model_path)
    targets = ["q_proj", "v_proj"]
    server = ServerProcess(
        SGLangConfig(server_timeout=120), model, engine="reference", log_path=tmp_path / "s.log"
    )
    await server.start()
    try:
        async with ServerClient(server.base_url) as client:
            for name, seed in (("kept", 1), ("other", 2)):
                await client.load_lora_adapter(
                    name, str(make_adapter(model, tmp_path / name, rank=4, targets=targets, seed=seed))
                )
        first = await bench_cycle.served_logprobs(server.base_url, None, "kept")
        again = await bench_cycle.served_logprobs(server.base_url, None, "kept")
        other = await bench_cycle.served_logprobs(server.base_url, None, "other")
        base = await bench_cycle.served_logprobs(server.base_url, None, None)
    finally:
        await server.stop()
    assert bench_cycle.logprobs_kept(first, again, 0.01) == (True, 0.0)
    for broken in (other, base, first[:-1]):
        kept, difference = bench_cycle.logprobs_kept(first, broken, 0.01)
        assert not kept and difference > 0.01
