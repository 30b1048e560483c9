"""scripts/probe_rollout_costs.py end to end on CPU, against a reference-engine server it starts: each way
sends its waves and reports tokens, the cached share and the server's processes' CPU; the ways that compute
a group's prompt once (prefill sharing through the gateway, `n` per group) find it cached."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import probe_rollout_costs  # noqa: E402


def test_each_way_is_measured_and_sharing_ways_find_the_prompt_cached(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    out = tmp_path / "costs.json"
    probe_rollout_costs.main(
        ["--engine", "reference", "--model", str(tiny_model_path), "--groups", "2", "--group-size", "3",
         "--tokens", "3", "--prompt-tokens", "60", "--seconds", "0.5", "--workdir", str(tmp_path),
         "--ways", "raw", "raw-n", "gateway-share", "--json", str(out)]
    )  # fmt: skip
    document = json.loads(out.read_text())
    runs = {run["way"]: run for run in document["runs"]}
    assert set(runs) == {"raw", "raw-n", "gateway-share"}
    for run in runs.values():
        assert run["waves"] >= 1 and run["output_tokens_per_s"] > 0
        assert sum(run["server_cpu_s"].values()) > 0  # the server's own processes were measured
    # 2 groups x 3: computed once per group, the other two requests of each find it (the probe's ~60
    # prompt tokens are most of each request's prompt).
    assert runs["raw-n"]["cached_share"] > 0.5 and runs["gateway-share"]["cached_share"] > 0.5
    assert "--lora-target-modules" in document["command"]
