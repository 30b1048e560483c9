"""Decode stalls in SGLang server logs: 40-step decode intervals that took far longer than their neighbours.

SGLang logs a line every 40 decode steps ("Decode batch, #running-req: R, #token: T, ... gen throughput
(token/s): X"). An interval whose batch neither gained nor lost a request (R unchanged, T grown by 40 R)
generated 40 R tokens in 40 R / X seconds. Such intervals back to back form a stretch; one taking more than
`STALL_FACTOR` times its stretch's median is a stall, and its time over the median is the stall's length.
Issue 39 found the backend's server stalling ~0.5 s about every 1.3 s of wall time (H200) once its KV pool
was full; the same server launched directly, in runs too short to fill it, never stalled
(`scripts/device/suite.sh` stall-*).

    python scripts/decode_stalls.py server.log [more.log ...] [--json stalls.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

STEPS_PER_LINE = 40  # SGLang's --decode-log-interval default
STALL_FACTOR = 1.5
MIN_STRETCH = 6  # intervals; shorter stretches have no reliable median
_DECODE = re.compile(
    r"^\[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] Decode batch, #running-req: (?P<running>\d+), "
    r"#token: (?P<tokens>\d+),.*gen throughput \(token/s\): (?P<rate>[\d.]+)"
)
_UP = re.compile(r"^\[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] The server is fired up")


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()


def stretches(lines: list[str]) -> tuple[list[list[tuple[float, float]]], float | None]:
    """The log's stretches of whole decode intervals, each a list of (logged time, seconds), and the time
    the server came up (None if the log does not say)."""
    found: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    previous: tuple[int, int] | None = None
    up = None
    for line in lines:
        if up is None and (started := _UP.match(line)):
            up = _seconds(started["time"])
        match = _DECODE.match(line)
        if match is None:
            continue
        running, tokens, rate = int(match["running"]), int(match["tokens"]), float(match["rate"])
        whole = previous == (running, tokens - STEPS_PER_LINE * running) and rate > 0
        if whole:
            current.append((_seconds(match["time"]), STEPS_PER_LINE * running / rate))
        elif current:
            found.append(current)
            current = []
        previous = (running, tokens)
    if current:
        found.append(current)
    return [s for s in found if len(s) >= MIN_STRETCH], up


def summarize(lines: list[str]) -> dict[str, Any]:
    """Stalls of one log: how many, their lengths, the wall time between them, their share of decode time,
    and when the first came (seconds after the server came up)."""
    found, up = stretches(lines)
    extra: list[float] = []
    gaps: list[float] = []
    stall_times: list[float] = []
    decode_s = 0.0
    for stretch in found:
        median = statistics.median(seconds for _, seconds in stretch)
        elapsed, last_end = 0.0, None
        for logged, seconds in stretch:
            elapsed += seconds
            decode_s += seconds
            if seconds > STALL_FACTOR * median:
                extra.append(seconds - median)
                stall_times.append(logged)
                if last_end is not None:
                    gaps.append(elapsed - last_end)
                last_end = elapsed
    return {
        "intervals": sum(len(s) for s in found),
        "stalls": len(extra),
        "stall_s_median": statistics.median(extra) if extra else None,
        "stall_share": sum(extra) / decode_s if decode_s else 0.0,
        "period_s_median": statistics.median(gaps) if gaps else None,
        "first_stall_after_up_s": stall_times[0] - up if stall_times and up is not None else None,
    }


def line(name: str, summary: dict[str, Any]) -> str:
    if not summary["stalls"]:
        return f"{name}: no stall in {summary['intervals']} whole decode intervals"
    period = summary["period_s_median"]
    onset = summary["first_stall_after_up_s"]
    return (
        f"{name}: {summary['stalls']} stalls in {summary['intervals']} whole decode intervals, "
        f"{summary['stall_s_median']:.2f} s each (median), {100 * summary['stall_share']:.0f} % of decode time"
        + (f", every {period:.2f} s" if period is not None else "")
        + (f", first {onset:.0f} s after the server came up" if onset is not None else "")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    summaries = {}
    for path in args.logs:
        summaries[str(path)] = summarize(path.read_text(errors="replace").splitlines())
        print(line(path.name, summaries[str(path)]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
