"""W&B reporting as ART's models do it, checked without a network: a recording stand-in for the `wandb`
module receives what would be sent. Off without WANDB_API_KEY; with it, every history row of the model
(model.log) goes to one run, under the same names ART's own `model.log` gives the same trajectories."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import art_sglang as art
from art_sglang.errors import ConfigError
from art_sglang.tracking import metric_key


class _Run:
    def __init__(self, **init: Any) -> None:
        self.init = init
        self.logged: list[dict[str, Any]] = []
        self.defined: list[tuple[str, str | None]] = []
        self._is_finished = False

    def log(self, payload: dict[str, Any]) -> None:
        self.logged.append(payload)

    def define_metric(self, name: str, step_metric: str | None = None, **_: Any) -> None:
        self.defined.append((name, step_metric))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[_Run]:
    """A `wandb` module that records its runs instead of reaching a server."""
    runs: list[_Run] = []
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> _Run:
        runs.append(_Run(**kwargs))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    module.Settings = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _groups() -> list[art.TrajectoryGroup]:
    return [
        art.TrajectoryGroup(
            [
                art.Trajectory(reward=1.0, metrics={"win": 1.0}),
                art.Trajectory(reward=0.0, metrics={"win": 0.0}),
            ]
        )
    ]


def _model(tmp_path: Path, **fields: Any) -> art.Model:
    return art.Model(name="agent", project="games", base_path=str(tmp_path), **fields)


def _history(tmp_path: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (tmp_path / "games/models/agent/history.jsonl").read_text().splitlines()
    ]


async def test_without_the_key_nothing_is_sent(tmp_path, fake_wandb, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    await _model(tmp_path).log(_groups(), split="train", step=0)
    await _model(tmp_path, report_metrics=["wandb"]).log(_groups(), split="train", step=1)
    assert fake_wandb == [] and len(_history(tmp_path)) == 2


async def test_with_the_key_every_row_goes_to_one_run_with_arts_names(
    tmp_path, fake_wandb, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "offline-test")
    model = _model(tmp_path)
    await model.log(_groups(), split="train", step=3)
    await model.log(metrics={"loss/train": 0.5, "accuracy": 0.9}, split="val", step=4)
    (run,) = fake_wandb
    assert run.init == {
        "project": "games",
        "name": "agent",
        "id": "agent",
        "resume": "allow",
        "reinit": "create_new",
    }
    assert ("train/*", "training_step") in run.defined and ("val/*", "training_step") in run.defined
    first, second = run.logged
    history = _history(tmp_path)
    assert {k: v for k, v in first.items() if k not in ("training_step", "time/wall_clock_sec")} == {
        k: v for k, v in history[0].items() if k not in ("step", "recorded_at")
    }
    assert first["train/reward"] == 0.5 and first["train/win"] == 0.5 and first["training_step"] == 3
    assert second["loss/train"] == 0.5 and second["val/accuracy"] == 0.9 and second["training_step"] == 4
    assert 0 <= first["time/wall_clock_sec"] <= second["time/wall_clock_sec"]
    assert metric_key("reward", "val") == "val/reward" and metric_key("custom/x", "val") == "val/custom/x"


async def test_report_metrics_empty_turns_it_off(tmp_path, fake_wandb, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "offline-test")
    await _model(tmp_path, report_metrics=[]).log(_groups(), split="train", step=0)
    assert fake_wandb == []


async def test_key_without_wandb_installed_warns_or_fails_when_asked_for(
    tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "offline-test")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with caplog.at_level(logging.WARNING, logger="art_sglang.tracking"):
        await _model(tmp_path).log(_groups(), split="train", step=0)
    assert "wandb is not installed" in caplog.text and len(_history(tmp_path)) == 1
    with pytest.raises(ConfigError, match="pip install wandb"):
        await _model(tmp_path, report_metrics=["wandb"]).log(_groups(), split="train", step=1)


async def test_names_match_arts_own_model_log(tmp_path, fake_wandb, monkeypatch, openpipe_art) -> None:
    ART = openpipe_art
    monkeypatch.setenv("WANDB_API_KEY", "offline-test")
    theirs = ART.Model(name="agent", project="games", base_path=str(tmp_path / "art"))
    trajectories = [
        ART.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=r, metrics={"win": r})
        for r in (1.0, 0.0)
    ]
    await theirs.log([ART.TrajectoryGroup(trajectories)], split="train", step=2)
    await theirs.log(metrics={"loss/train": 0.5, "accuracy": 0.9}, split="val", step=2)
    ours = _model(tmp_path)
    await ours.log(_groups(), split="train", step=2)
    await ours.log(metrics={"loss/train": 0.5, "accuracy": 0.9}, split="val", step=2)
    art_run, our_run = fake_wandb
    for art_row, our_row in zip(art_run.logged, our_run.logged, strict=True):
        # ART adds its own data/* bookkeeping; every name we send is one ART sends, with the same value.
        assert set(our_row) <= set(art_row), set(our_row) - set(art_row)
        assert {k: v for k, v in our_row.items() if k != "time/wall_clock_sec"} == pytest.approx(
            {k: art_row[k] for k in our_row if k != "time/wall_clock_sec"}
        )
    assert set(our_run.defined) <= set(art_run.defined)
