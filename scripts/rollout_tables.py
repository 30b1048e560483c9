"""`bench_rollouts.py`'s results pooled and put in tables: one generator for the side-by-side of
docs/benchmarks.md.

`compare` pools the side documents of one model (each entry keeps the machine it ran on) and computes,
per workload and client, each backend configuration's ratio to every server measured directly (vLLM with
LoRA, vLLM's base weights, SGLang direct): the ratio of medians, and its range over every pairing of
repeats (slowest against fastest, fastest against slowest). `table` writes every entry as a row;
`headline` the one table docs/benchmarks.md shows: a row per workload, a column per server and client.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from bench_common import markdown_table

CLIENT_NAMES = {"bare": "bare", "art": "ART's client"}
# The backend's passes of an A/B/A order ("A1", "A2"): one configuration, pooled in the headline. Any other
# label names a configuration of its own (e.g. other LoRA kernels), which keeps its column.
PASS_LABEL = re.compile(r"A\d+")
# What a compared document keeps of each side's: the server, the machine, its launch and memory.
SOURCE_KEYS = ("side", "engine", "variant", "weights", "label", "device", "date", "machine", "start_s", "wall_s",
               "layout", "sglang_config", "launch", "server_info", "gpu_processes", "served_step",
               "trained_steps")  # fmt: skip


def entry_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What tells results apart: the server (side, engine, variant), the pass, and the configuration."""
    return (
        entry["side"], entry["engine"], entry.get("variant", ""), entry.get("label", ""),
        entry.get("route", ""), entry["merging"], entry.get("client", "art"), entry["run"],
    )  # fmt: skip


def source_name(entry: dict[str, Any]) -> str:
    """The server and route of an entry, in words (its pass label included)."""
    label = f" {entry['label']}" if entry.get("label") else ""
    if entry["side"] == "backend":
        name = "backend" if entry.get("route", "gateway") == "gateway" else "backend's server, no gateway"
        variant = entry.get("variant", "lora")
        if variant.startswith("merged"):  # weight_sync_method="merged": no LoRA kernels
            name += ", merged"
        # Kernels or backports other than the defaults of their day (rollout_options.variant): a column of
        # their own, never pooled with the default backend's.
        name += variant.removeprefix("merged").removeprefix("lora")
        if entry.get("merging") == "off":
            name += ", sharing off"
        return name + label
    variant = entry.get("variant", "lora")
    engine = {"vllm": "vLLM", "sglang": "SGLang direct", "reference": "reference direct"}[entry["engine"]]
    if variant.startswith("base"):
        return f"{engine} base{variant[4:]}{label}"
    return f"{engine}+LoRA{variant[4:]}{label}"


def _rates(entry: dict[str, Any]) -> list[float]:
    return [r["output_tokens_per_s"] for r in entry["runs"]]


def compare(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Every document's entries pooled (a later document's entry replaces an earlier one's of the same
    key), with the ratios of each backend entry to each direct one of the same workload and client."""
    models = {d["model"] for d in documents}
    if len(models) != 1:
        raise SystemExit(f"--compare: the results are of different models: {sorted(models)}")
    entries: dict[tuple[Any, ...], dict[str, Any]] = {}
    for document in documents:
        gpu = (document.get("machine") or {}).get("gpu_details") or [{}]
        for entry in document["results"]:
            entries[entry_key(entry)] = {**entry, "device": document["device"], "date": document["date"],
                                         "gpu_uuid": gpu[0].get("uuid")}  # fmt: skip
    direct = [e for e in entries.values() if e["side"] == "direct"]
    ratios = []
    for mine in entries.values():
        if mine["side"] != "backend":
            continue
        for theirs in direct:
            if (theirs["run"], theirs.get("client", "art")) != (mine["run"], mine.get("client", "art")):
                continue
            ratio = {"run": mine["run"], "client": mine.get("client", "art"), "backend": source_name(mine),
                     "to": source_name(theirs)}  # fmt: skip
            for key in ("output_tokens_per_s", "latency_median_s", "latency_p99_s"):
                if key in mine["median"] and theirs["median"].get(key):
                    ratio[key] = mine["median"][key] / theirs["median"][key]
            a, b = _rates(mine), _rates(theirs)
            if a and b:
                ratio["output_tokens_per_s_range"] = [min(a) / max(b), max(a) / min(b)]
            ratios.append(ratio)
    machines = {e["gpu_uuid"] for e in entries.values() if e.get("gpu_uuid")}
    return {
        "benchmark": "rollouts (compared)",
        "model": models.pop(),
        "model_description": next(
            (d["model_description"] for d in documents if "model_description" in d), None
        ),
        "one_machine": len(machines) == 1 if machines else None,
        "versions": {k: v for d in documents for k, v in d["versions"].items() if v is not None},
        "sources": [{key: d.get(key) for key in SOURCE_KEYS} for d in documents],
        "results": list(entries.values()),
        "ratios": ratios,
        "lone_requests": {
            f"{d['side']} {d['engine']} {d.get('variant', '')} {d.get('label', '')}".strip(): d[
                "lone_requests"
            ]
            for d in documents
            if "lone_requests" in d
        },
    }


def _cell(entries: list[dict[str, Any]]) -> str:
    """Median over the pooled repeats of `entries`, with the slowest and fastest repeat."""
    rates = [rate for entry in entries for rate in _rates(entry)]
    if not rates:
        return "—"
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f})"


def headline(document: dict[str, Any]) -> str:
    """Docs' table: a row per workload, output tokens/s per server and client (median of the repeats,
    slowest–fastest), the engine ratio (bare clients: backend / vLLM+LoRA), ART's client's ratio, and the
    backend against SGLang served directly with its flags; the backend in merged mode, where measured,
    against vLLM+LoRA and vLLM's base weights (issue 40). The backend's passes (A1, A2) are pooled; a
    backend configuration of another label keeps its column and gets its own bare ratio to vLLM+LoRA."""
    columns: dict[str, list[dict[str, Any]]] = {}
    for entry in document["results"]:
        label = entry.get("label", "")
        name = source_name({**entry, "label": "" if PASS_LABEL.fullmatch(label) else label})
        if entry.get("merging") == "off":
            continue
        columns.setdefault(f"{name} · {entry.get('client', 'art')}", []).append(entry)
    order = sorted(columns, key=lambda c: (not c.startswith("backend"), "vLLM" not in c, c))
    runs = sorted(
        {e["run"] for e in document["results"]},
        key=lambda r: (r.split("-")[0], int(r.split("-")[1].split(":")[0]), r),
    )

    def ratio(run: str, client: str, to: str, backend: str = "backend") -> str:
        mine = [r for e in columns.get(f"{backend} · {client}", []) if e["run"] == run for r in _rates(e)]
        theirs = [r for e in columns.get(f"{to} · {client}", []) if e["run"] == run for r in _rates(e)]
        if not mine or not theirs:
            return "—"
        value = statistics.median(mine) / statistics.median(theirs)
        return f"**{value:.2f}** ({min(mine) / max(theirs):.2f}–{max(mine) / min(theirs):.2f})"

    exact = [c for c in order if c.startswith("SGLang direct+LoRA, backend flags") and " -" not in c]
    direct = exact[0].split(" · ")[0] if exact else None
    headers = ["workload", *order, "backend / vLLM+LoRA, bare", "backend / vLLM+LoRA, ART's client"]
    if direct:
        headers.append(f"backend / {direct}, bare")
    merged = "backend, merged"
    # (client, server): the merged backend's ratios to the vLLM servers measured with that client
    against = [(c, to) for c in CLIENT_NAMES for to in ("vLLM+LoRA", "vLLM base")
               if f"{merged} · {c}" in columns and f"{to} · {c}" in columns]  # fmt: skip
    headers += [f"{merged} / {to}, {CLIENT_NAMES[c]}" for c, to in against]
    # Other backend configurations (a label, or kernels/backports of their own), not merged mode's.
    backends = {
        name
        for c in order
        if c.endswith(" · bare")
        and (name := c.split(" · ")[0]).startswith(("backend ", "backend, "))
        and not name.startswith(merged)
    }
    labelled = sorted(backends - {"backend"})
    headers += [f"{name} / vLLM+LoRA, bare" for name in labelled]
    rows = []
    for run in runs:
        row = [run, *(_cell([e for e in columns[c] if e["run"] == run]) for c in order)]
        row += [ratio(run, "bare", "vLLM+LoRA"), ratio(run, "art", "vLLM+LoRA")]
        if direct:
            row.append(ratio(run, "bare", direct))
        row += [ratio(run, c, to, merged) for c, to in against]
        row += [ratio(run, "bare", "vLLM+LoRA", name) for name in labelled]
        rows.append(row)
    return markdown_table(headers, rows)


def table(document: dict[str, Any]) -> str:
    """Every entry a row (median, spread, latency, caching), then the headline table."""
    headers = ["run", "server", "client", "repeats", "output tok/s", "slowest–fastest", "latency p50 s",
               "latency p99 s", "cached", "server cached", "mean output tokens"]  # fmt: skip
    rows = []
    for e in sorted(document["results"], key=lambda e: (e["run"], source_name(e), e.get("client", "art"))):
        m, rates = e["median"], _rates(e)
        rows.append([
            e["run"], source_name(e), e.get("client", "art"), len(e["runs"]), m.get("output_tokens_per_s", 0.0),
            f"{min(rates):,.0f}–{max(rates):,.0f}" if rates else "-", m.get("latency_median_s", 0.0),
            m.get("latency_p99_s", 0.0), f"{100 * m.get('cached_share', 0.0):.1f}%",
            f"{100 * m['server_cached_share']:.1f}%" if "server_cached_share" in m else "-",
            round(m.get("mean_completion_tokens", 0.0)),
        ])  # fmt: skip
    lone = document.get("lone_requests") or {}
    if "side" in document:  # one side's document
        lone = {f"{document['side']} {document['engine']}": lone} if lone else {}
    lines = [
        f"{source}, merging {label}: TTFT {1000 * row['ttft_s_median']:.1f} ms median "
        f"(p90 {1000 * row['ttft_s_p90']:.1f}), one-token request {1000 * row['one_token_s_median']:.1f} ms"
        for source, settings in lone.items()
        for label, row in settings.items()
    ]
    head = f"{document['model']}; medians over repeats; output tokens/s over whole runs of waves"
    parts = [head, "", markdown_table(headers, rows), "", headline(document)]
    return "\n".join([*parts, *(["", *lines] if lines else [])])
