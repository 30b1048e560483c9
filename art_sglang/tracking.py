"""ART's metric names, and the optional Weights & Biases mirror of a model's history rows.

As ART 0.5.x's models do: when `WANDB_API_KEY` is set (and `report_metrics` is None or lists "wandb"),
every row a model writes to history.jsonl also goes to the W&B run of the model (project = model.project,
name = id = model.name, resumed when it exists), with `training_step` and `time/wall_clock_sec` added
and every section plotted against `training_step`. Without the key nothing is imported or sent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .errors import ConfigError

logger = logging.getLogger(__name__)

WANDB_KEY_ENV = "WANDB_API_KEY"
STEP_METRIC = "training_step"
WALL_CLOCK_METRIC = "time/wall_clock_sec"
# A key whose first component is one of these keeps its name; any other key is put under the split.
METRIC_SECTIONS = frozenset(
    {"reward", "loss", "offpolicy", "pipeline", "throughput", "costs", "time", "data"}
)
METRIC_SPLITS = frozenset({"train", "val", "test"})
# The sections ART's runs plot against training_step.
_STEPPED = ("reward", "loss", "throughput", "costs", "time", "data", "train", "val", "test", "discarded")


def metric_key(key: str, split: str) -> str:
    """The name ART logs `key` under for `split` (e.g. "reward" -> "val/reward", "loss/train" kept)."""
    if split in METRIC_SPLITS and "/" in key and key.split("/", 1)[0] in METRIC_SECTIONS | METRIC_SPLITS:
        return key
    return f"{split}/{key}"


class WandbReporter:
    """The W&B run of one model, started on the first row; does nothing unless W&B reporting is on."""

    def __init__(self, project: str, name: str, report_metrics: list[str] | None) -> None:
        self._project, self._name = project, name
        self._explicit = report_metrics is not None and "wandb" in report_metrics
        self._wanted = WANDB_KEY_ENV in os.environ and (report_metrics is None or self._explicit)
        self._started = time.time()
        self._run: Any = None

    @property
    def enabled(self) -> bool:
        return self._wanted

    def report(self, step: int, row: dict[str, Any]) -> None:
        """Send one history row (blocking: W&B may talk to its server)."""
        if not self._wanted:
            return
        run = self._run or self._start()
        if run is None:
            return
        payload = {key: value for key, value in row.items() if key not in ("step", "recorded_at")}
        payload[STEP_METRIC] = step
        payload[WALL_CLOCK_METRIC] = time.time() - self._started
        run.log(payload)

    def _start(self) -> Any:
        try:
            import wandb
        except ImportError:
            if self._explicit:
                raise ConfigError(
                    "report_metrics=['wandb'] but wandb is not installed: pip install wandb"
                ) from None
            logger.warning("%s is set but wandb is not installed: not logging to W&B", WANDB_KEY_ENV)
            self._wanted = False
            return None
        run = wandb.init(
            project=self._project, name=self._name, id=self._name, resume="allow", reinit="create_new"
        )
        run.define_metric(STEP_METRIC)
        run.define_metric(WALL_CLOCK_METRIC)
        for section in _STEPPED:
            run.define_metric(f"{section}/*", step_metric=STEP_METRIC)
        self._run = run
        return run
