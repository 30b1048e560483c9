"""scripts/decode_stalls.py: stalls found in SGLang decode log lines (whole 40-step intervals only), their
length, the wall time between them, and when the first came after the server came up."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import decode_stalls

UP = datetime(2026, 11, 28, 6, 18, 0)


def decode_line(at: datetime, running: int, tokens: int, seconds: float) -> str:
    """SGLang's decode line for an interval of 40 steps of `running` requests that took `seconds`."""
    rate = 40 * running / seconds
    return (
        f"[{at:%Y-%m-%d %H:%M:%S}] Decode batch, #running-req: {running}, #token: {tokens}, token usage: 0.01, "
        f"cuda graph: True, gen throughput (token/s): {rate:.2f}, #queue-req: 0"
    )


def wave(start: datetime, intervals: list[float], running: int = 128) -> list[str]:
    """A wave's first line (after its prefill: not a whole interval) and one line per interval."""
    lines, at, tokens = [decode_line(start, running, 20000, 1.0)], start, 20000
    for seconds in intervals:
        at, tokens = at + timedelta(seconds=seconds), tokens + 40 * running
        lines.append(decode_line(at, running, tokens, seconds))
    return lines


def test_every_third_interval_stalling_half_a_second() -> None:
    normal, stalled = 0.25, 0.75
    intervals = [normal, normal, stalled] * 6
    lines = [f"[{UP:%Y-%m-%d %H:%M:%S}] The server is fired up and ready to roll!"]
    lines += wave(UP + timedelta(seconds=100), intervals)
    lines.append('[2026-11-28 06:20:00] INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')
    summary = decode_stalls.summarize(lines)
    assert summary["intervals"] == 18 and summary["stalls"] == 6
    assert summary["stall_s_median"] == pytest.approx(stalled - normal)
    assert summary["period_s_median"] == pytest.approx(2 * normal + stalled)
    assert summary["stall_share"] == pytest.approx(6 * 0.5 / sum(intervals))
    # The first stall ends 1.75 s into the wave; its line's time is logged in whole seconds.
    assert summary["first_stall_after_up_s"] == pytest.approx(101, abs=1)


def test_a_batch_that_changes_is_not_an_interval() -> None:
    """Requests finishing or joining change #running-req (or #token by other than 40 a request): such a
    line measures no whole interval, and a stretch too short for a median is left out."""
    steady = wave(UP, [0.25] * 8)
    shrinking = [decode_line(UP, 100 - n, 10000 + 4000 * n, 2.0) for n in range(10)]
    short = wave(UP, [0.25, 0.25, 2.0])
    summary = decode_stalls.summarize(steady + shrinking + short)
    assert summary["intervals"] == 8 and summary["stalls"] == 0 and summary["first_stall_after_up_s"] is None


def test_the_command_line_reports_each_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stalling, smooth = tmp_path / "backend.log", tmp_path / "direct.log"
    stalling.write_text("\n".join(wave(UP, [0.25, 0.25, 0.75] * 4)) + "\n")
    smooth.write_text("\n".join(wave(UP, [0.25] * 12)) + "\n")
    decode_stalls.main([str(stalling), str(smooth), "--json", str(tmp_path / "stalls.json")])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("backend.log: 4 stalls in 12 whole decode intervals, 0.50 s each")
    assert printed[1] == "direct.log: no stall in 12 whole decode intervals"
    saved = json.loads((tmp_path / "stalls.json").read_text())
    assert saved[str(stalling)]["stalls"] == 4 and saved[str(smooth)]["stalls"] == 0
