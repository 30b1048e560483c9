"""What a torch.profiler Chrome trace (`.json` or `.json.gz`, as the trainer's step profile writes it,
training/step_profile.py) says about who set the pace: the GPU's busy time (the union of its kernels,
copies and memsets) against the wall time, the host's CUDA API calls, the GPU's idle gaps and what the
host ran during the longest ones, and the costliest kernels.

    python scripts/trace_summary.py train3-rank0-of-3.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path
from typing import Any

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_OPS = ("cpu_op", "user_annotation", "python_function")


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (phase "X")."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as stream:
        return [e for e in json.load(stream)["traceEvents"] if e.get("ph") == "X"]


def summary(events: list[dict[str, Any]], gaps_shown: int = 15) -> str:
    start = min(e["ts"] for e in events)
    wall = (max(e["ts"] + e["dur"] for e in events) - start) / 1e6
    work = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in GPU_WORK)
    busy, gaps = 0.0, []
    first = last = None
    for begin, end, _ in work:
        if last is None or begin > last:
            if last is not None:
                busy += last - first
                gaps.append((begin - last, last, begin))
            first, last = begin, end
        else:
            last = max(last, end)
    if last is not None:
        busy += last - first
    lines = [
        f"wall {wall:.3f} s, GPU busy (union of kernels and copies) {busy / 1e6:.3f} s = "
        f"{busy / 1e6 / wall:.1%}, {len(work)} kernels and copies"
    ]
    api_time: collections.Counter[str] = collections.Counter()
    api_calls: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api_time[e["name"]] += e["dur"]
            api_calls[e["name"]] += 1
    lines.append("host CUDA API calls (s, count):")
    lines += [f"  {name:40s} {t / 1e6:8.3f} {api_calls[name]:7d}" for name, t in api_time.most_common(12)]
    gaps.sort(reverse=True)
    long = [g for g in gaps if g[0] > 1000]
    lines.append(
        f"GPU idle {sum(g[0] for g in gaps) / 1e6:.3f} s in {len(gaps)} gaps; "
        f"over 1 ms: {sum(g[0] for g in long) / 1e6:.3f} s in {len(long)}"
    )
    host = sorted(
        ((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in HOST_OPS),
        key=lambda op: (op[0], -op[1]),
    )
    starts = [op[0] for op in host]

    def running(at: float) -> list[str]:
        """The innermost host operations running at `at` (looking back over the last 4,000 that began)."""
        index = bisect.bisect_right(starts, at)
        spans = [(end - begin, name) for begin, end, name in host[max(0, index - 4000) : index] if end >= at]
        return [name for _, name in sorted(spans)[:3]]

    lines.append("longest gaps (ms, at s from the start, the host's innermost operations then):")
    for length, begin, end in gaps[:gaps_shown]:
        lines.append(f"  {length / 1e3:8.2f} @ {(begin - start) / 1e6:7.3f}  {running((begin + end) / 2)}")
    kernels: collections.Counter[str] = collections.Counter()
    for begin, end, name in work:
        kernels[name[:60]] += end - begin
    lines.append("costliest kernels and copies (s):")
    lines += [f"  {t / 1e6:7.3f} {name}" for name, t in kernels.most_common(12)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, nargs="+")
    args = parser.parse_args()
    for path in args.trace:
        print(f"== {path.name}")
        print(summary(load_events(path)))


if __name__ == "__main__":
    main()
