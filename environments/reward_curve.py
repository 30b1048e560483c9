"""A run's reward curve: the per-step results as JSON and a PNG of the mean reward and its spread, both
written next to the run's history.jsonl (`rewards.json`, `reward_curve.png`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_FILE = "rewards.json"
PLOT_FILE = "reward_curve.png"


def write_results(model_dir: Path, rows: list[dict[str, Any]], *, title: str) -> tuple[Path, Path | None]:
    """Write `rows` (one per step, oldest first) to `model_dir/rewards.json`, after the rows of an earlier
    run of the same model that precede them (a resumed run continues its curve), and plot them all.

    Returns the JSON path and the PNG path, or None for the PNG when matplotlib is not installed.
    """
    results = model_dir / RESULTS_FILE
    earlier = json.loads(results.read_text()) if results.exists() and rows else []
    first = rows[0]["step"] if rows else 0
    merged = [row for row in earlier if row["step"] < first] + rows
    model_dir.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(merged, indent=2) + "\n")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return results, None
    png = model_dir / PLOT_FILE
    _plot(Figure(figsize=(7, 4), dpi=100), merged, png, title)
    return results, png


def _plot(figure: Any, rows: list[dict[str, Any]], png: Path, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    # Figure without pyplot: no global state and no display backend, so it works in threads and headless.
    steps = [row["step"] for row in rows]
    mean = [row["mean_reward"] for row in rows]
    axes = figure.subplots()
    axes.fill_between(
        steps, [r["min_reward"] for r in rows], [r["max_reward"] for r in rows],
        color="tab:blue", alpha=0.12, linewidth=0, label="min–max",
    )  # fmt: skip
    low = [row["mean_reward"] - row["std_reward"] for row in rows]
    high = [row["mean_reward"] + row["std_reward"] for row in rows]
    axes.fill_between(steps, low, high, color="tab:blue", alpha=0.3, linewidth=0, label="mean ± std")
    axes.plot(steps, mean, color="tab:blue", marker="o", markersize=3, label="mean reward")
    axes.set_xlabel("step (the adapter that produced the rollouts)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no ticks at 2.5
    axes.set_ylabel("reward")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(png)
