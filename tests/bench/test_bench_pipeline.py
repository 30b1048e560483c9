"""scripts/bench_pipeline.py's rates: what a loop's step ends and trained trajectories come to (the loops
themselves run through the backend in tests/test_pipelining.py and on the GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_pipeline
from bench_pipeline import loop_rates, pipeline_history, ratio


def test_steady_rates_leave_out_the_first_step_and_count_trained_trajectories() -> None:
    # A 40 s first step (the trainer compiling), then 10 s steps; the last step trained 16 of 64.
    rates = loop_rates(0.0, [40.0, 50.0, 60.0, 70.0], [64, 64, 64, 16])
    assert rates["steps"] == 4 and rates["wall_s"] == 70.0
    assert rates["step_s"] == [40.0, 10.0, 10.0, 10.0]
    assert rates["steps_per_minute"] == pytest.approx(60 * 4 / 70)
    assert rates["steady_steps_per_minute"] == pytest.approx(6.0)
    assert rates["steady_trajectories_per_minute"] == pytest.approx(60 * 144 / 30)
    one_step = loop_rates(0.0, [40.0], [64])
    assert one_step["steady_steps_per_minute"] is None and one_step["steady_trajectories_per_minute"] is None


def test_the_loops_compare_only_at_equal_trained_work() -> None:
    sync = loop_rates(0.0, [40.0, 50.0, 60.0, 70.0], [64, 64, 64, 64])
    pipelined = loop_rates(0.0, [40.0, 48.0, 56.0, 70.0], [64, 64, 64, 64])
    loops = {"sync": sync, "pipelined": pipelined}
    assert ratio(loops, "steady_trajectories_per_minute") == pytest.approx(30 / 30)
    # The median step leaves out the slow one (14 s: a recompile).
    assert pipelined["median_step_s"] == 8.0 and ratio(loops, "median_step_s") == pytest.approx(0.8)
    # A loop that stopped early (7 steps of 8, or a short last step) is no comparison: by steps it would
    # look faster than the work it did.
    short = loop_rates(0.0, [40.0, 49.0, 58.0, 61.0], [64, 64, 64, 16])
    assert ratio({"sync": sync, "pipelined": short}, "steady_trajectories_per_minute") is None
    fewer = loop_rates(0.0, [40.0, 49.0, 58.0], [64, 64, 64])
    assert ratio({"sync": sync, "pipelined": fewer}, "steady_steps_per_minute") is None
    one = loop_rates(0.0, [1.0], [8])
    assert ratio({"sync": one, "pipelined": one}, "steady_steps_per_minute") is None


def test_pipeline_history_reads_arts_staleness_and_discards(tmp_path: Path) -> None:
    # As PipelineTrainer writes history.jsonl: a train row per step (the cumulative discards), other rows.
    rows = [
        {"step": 1, "train/steps_off_policy": 1.0, "train/discarded_stale_groups": 0.0},
        {"step": 1, "checkpoint/saved": 1.0},
        {"step": 2, "train/steps_off_policy": 3.0, "train/discarded_stale_groups": 5.0},
    ]
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert pipeline_history(history) == {"art_steps_off_policy": [1.0, 3.0], "discarded_stale_groups": 5}


def test_merged_weights_run_each_loop_on_its_own_backend(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merged weights are one model's per backend: `--weights merged` runs the synchronous and the pipelined
    loop each on its own backend (its own folder), and both train the same work (issue 40's comparison)."""
    pytest.importorskip("art")
    out = tmp_path / "out.json"
    argv = ["bench_pipeline.py", "--model", str(tiny_model_path), "--layout", "cpu", "--weights", "merged",
            "--steps", "2", "--groups", "2", "--group-size", "2", "--max-tokens", "8",
            "--max-steps-off-policy", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_pipeline.main()
    result = json.loads(out.read_text())
    assert result["weights"] == "merged" and result["sglang_config"]["weight_sync_method"] == "merged"
    loops = result["loops"]
    assert loops["sync"]["trajectories"] == loops["pipelined"]["trajectories"] == [4, 4]
    assert result["speedup"] is not None
    runs = tmp_path / "work" / "pipeline-cpu-merged"
    for loop, other in (("sync", "pipelined"), ("pipelined", "sync")):
        models = runs / loop / ".art" / "bench-pipeline" / "models"
        assert (models / f"bench-{loop}").is_dir() and not (models / f"bench-{other}").exists()
