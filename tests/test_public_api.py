"""The public API: names as in OpenPipe ART 0.5.x, and the model's side of the backend protocol.

The backend here is a plain test double of the protocol (no server involved): these tests are about what
the model does with the answers, errors before register, and the checkpoint selection on a real
history.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

import art_sglang as art
from art_sglang.errors import ConfigError, ModelNotRegisteredError
from art_sglang.storage.model_store import ModelStore


def store(model: art.Model) -> ModelStore:
    """Where the model's files are (`<base_path>/<project>/models/<name>`, as in ART)."""
    return ModelStore(model.base_path, model.project, model.name)


def test_every_public_name_resolves():
    for name in art.__all__:
        assert getattr(art, name) is not None, name
    namespace: dict = {}
    exec("from art_sglang import *", namespace)
    assert set(art.__all__) <= set(namespace)


def test_every_error_class_is_exported():
    errors = [
        v for v in vars(art.errors).values() if isinstance(v, type) and issubclass(v, art.ArtSGLangError)
    ]
    assert {e.__name__ for e in errors} <= set(art.__all__)


def test_import_is_light():
    # Building trajectories must not pull in torch or start anything.
    code = "import sys, art_sglang; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_names_and_fields_match_openpipe_art(openpipe_art):
    ART = openpipe_art
    assert set(art.Trajectory.model_fields) == set(ART.Trajectory.model_fields)
    assert set(art.TrajectoryGroup.model_fields) == set(ART.TrajectoryGroup.model_fields)
    assert [f.name for f in dataclasses.fields(art.TrainResult)] == ["step", "metrics"]
    assert [f.name for f in dataclasses.fields(ART.TrainResult)] == ["step", "metrics"]
    local = ["step", "metrics", "checkpoint_path"]
    assert [f.name for f in dataclasses.fields(art.LocalTrainResult)] == local
    assert [f.name for f in dataclasses.fields(ART.LocalTrainResult)] == local
    assert set(art.TrainSFTConfig.model_fields) == set(ART.TrainSFTConfig.model_fields)
    assert art.TrainSFTConfig().model_dump() == ART.TrainSFTConfig().model_dump()
    assert set(art.TrainSFTConfig.model_fields) == set(ART.TrainSFTConfig.model_fields)
    assert art.TrainSFTConfig().model_dump() == ART.TrainSFTConfig().model_dump()
    for field in ("learning_rate", "kl_penalty_coef"):
        assert art.TrainConfig().model_dump()[field] == ART.TrainConfig().model_dump()[field]
    ours = set(art.TrainableModel.model_fields)
    theirs = set(ART.TrainableModel.model_fields) - {"report_metrics"}  # W&B reporting: not ours
    assert theirs <= ours, theirs - ours
    for method in (
        "register",
        "openai_client",
        "get_inference_name",
        "get_step",
        "log",
        "delete_checkpoints",
        "train_sft",
    ):
        assert callable(getattr(art.TrainableModel, method)) and hasattr(ART.TrainableModel, method)


def test_art_groups_convert_to_ours_with_choices_kept(openpipe_art):
    ART = openpipe_art
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "hi"},
        "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105], "top_logprobs": []}]},
    }
    theirs = ART.TrajectoryGroup(
        [
            ART.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "x"},
                    art.types.Choice.model_validate(choice),
                ],
                reward=1.0,
            ),
            ValueError("lost"),
        ]
    )
    ours = art.TrajectoryGroup.model_validate(theirs.model_dump())
    assert isinstance(ours.trajectories[0].messages_and_choices[1], art.types.Choice)
    assert ours.trajectories[0].messages_and_choices[1].logprobs.content[0].logprob == -0.5
    assert ours.exceptions[0].message == "lost"


def test_train_config_accepts_the_old_beta_name_and_rejects_unknown_options():
    assert art.TrainConfig(beta=0.1).kl_penalty_coef == 0.1
    with pytest.raises(ValueError, match="extra"):
        art.TrainConfig(learnig_rate=1e-5)


class ProtocolBackend:
    """A test double of the backend protocol, keeping checkpoints as real directories."""

    def __init__(self, step: int = 0, base_url: str = "http://127.0.0.1:30000/v1") -> None:
        self.step = step
        self.base_url = base_url
        self.calls: list[tuple[str, Any]] = []

    async def register(self, model: art.Model) -> None:
        self.calls.append(("register", model.name))

    async def _prepare_backend_for_training(self, model: art.TrainableModel, config: Any) -> tuple[str, str]:
        return self.base_url, "secret"

    def _model_inference_name(self, model: art.Model, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def _get_step(self, model: art.TrainableModel) -> int:
        return self.step

    async def train(
        self, model: art.TrainableModel, trajectory_groups: Any, **options: Any
    ) -> art.TrainResult:
        self.calls.append(("train", (list(trajectory_groups), options)))
        self.step += 1
        return art.TrainResult(step=self.step, metrics={"loss": 0.1})

    async def _delete_checkpoint_files(self, model: art.TrainableModel, steps_to_keep: list[int]) -> None:
        self.calls.append(("delete", steps_to_keep))
        for checkpoint in store(model).checkpoints_dir.iterdir():
            if int(checkpoint.name) not in steps_to_keep:
                shutil.rmtree(checkpoint)

    async def close(self) -> None:
        pass


class LoggingBackend(ProtocolBackend):
    async def _log(self, model: art.Model, groups: list[art.TrajectoryGroup], split: str) -> None:
        self.calls.append(("log", (len(groups), split)))


@pytest.fixture
def model(tmp_path: Path) -> art.TrainableModel:
    return art.TrainableModel(
        name="agent-001", project="tic-tac-toe", base_model="tiny", base_path=str(tmp_path)
    )


async def test_trainable_model_before_register_says_to_register(model):
    group = art.TrajectoryGroup([art.Trajectory(reward=1)])
    for call in (model.openai_client, model.get_inference_name, model.backend):
        with pytest.raises(ModelNotRegisteredError, match=r"register\(backend\)"):
            call()
    for coroutine in (
        model.get_step(),
        model.train([group]),
        model.delete_checkpoints(),
        model.log([group]),
    ):
        with pytest.raises(ValueError, match=r"register\(backend\)"):  # ValueError as in ART
            await coroutine


def test_prompted_model_client_and_names():
    prompted = art.Model(name="gpt", project="p")
    assert prompted.get_inference_name() == "gpt" and prompted.get_inference_name(2) == "gpt@2"
    with pytest.raises(ConfigError, match="inference_base_url"):
        prompted.openai_client()
    prompted.inference_base_url, prompted.inference_api_key = "http://127.0.0.1:9/v1", "k"
    prompted.inference_model_name = "served-name"
    assert str(prompted.openai_client().base_url) == "http://127.0.0.1:9/v1/"
    assert prompted.get_inference_name() == "served-name"


@pytest.mark.parametrize("bad", ["", "a/b", "a@1", "..", "a\\b", "a:b", "a\x00b", "a\nb"])
def test_model_names_must_be_usable_in_paths_and_adapter_names(bad):
    with pytest.raises(ValueError, match="cannot be used"):
        art.TrainableModel(name=bad, project="p", base_model="tiny")


async def test_register_rejects_a_config_that_cannot_be_saved(model):
    model.config = {"handle": object()}
    with pytest.raises(ConfigError, match="JSON-serializable"):
        await model.register(ProtocolBackend())


async def test_register_points_the_model_at_the_backend(model):
    backend = ProtocolBackend(step=3)
    await model.register(backend)
    assert backend.calls == [("register", "agent-001")]
    assert (model.inference_base_url, model.inference_api_key) == ("http://127.0.0.1:30000/v1", "secret")
    assert model.inference_model_name == "agent-001@3"
    assert model.get_inference_name() == "agent-001@3" and model.get_inference_name(1) == "agent-001@1"
    assert await model.get_step() == 3
    client = model.openai_client()
    assert client is model.openai_client()  # cached
    assert str(client.base_url) == "http://127.0.0.1:30000/v1/" and client.api_key == "secret"
    assert client.timeout.read == 1200.0
    # A new server (e.g. another backend) gets a new client.
    await model.register(ProtocolBackend(base_url="http://127.0.0.1:30001/v1"))
    assert str(model.openai_client().base_url) == "http://127.0.0.1:30001/v1/"
    assert json.loads(model.model_dump_json())["inference_model_name"] == "agent-001@0"


class FailingBackend(ProtocolBackend):
    async def _prepare_backend_for_training(self, model: art.TrainableModel, config: Any) -> tuple[str, str]:
        raise art.ServerStartError("server exited with code 1")


async def test_failed_register_leaves_the_model_unregistered(model):
    await model.register(ProtocolBackend())
    with pytest.raises(art.ServerStartError):
        await model.register(FailingBackend())
    assert model.inference_base_url is None and model.inference_model_name is None
    with pytest.raises(ModelNotRegisteredError):
        model.openai_client()
    with pytest.raises(ModelNotRegisteredError):
        await model.get_step()


async def test_openai_client_makes_real_requests(model):
    with socket.socket() as probe:  # a port nobody listens on: the request must fail as a connection error
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await model.register(ProtocolBackend(base_url=f"http://127.0.0.1:{port}/v1"))
    with pytest.raises(openai.APIConnectionError):
        await model.openai_client().with_options(max_retries=0).models.list()


async def test_old_style_model_train(model):
    backend = ProtocolBackend()
    await model.register(backend)
    group = art.TrajectoryGroup([art.Trajectory(reward=1)])
    result = await model.train(
        (g for g in [group]), config=art.TrainConfig(learning_rate=1e-5, beta=0.2), _config={"epsilon": 0.3}
    )
    assert result == art.TrainResult(step=1, metrics={"loss": 0.1})
    [(_, (groups, options))] = [c for c in backend.calls if c[0] == "train"]
    assert groups == [group]
    assert options == {"learning_rate": 1e-5, "kl_penalty_coef": 0.2, "verbose": False, "epsilon": 0.3}


async def test_log_appends_history_rows(model):
    backend = LoggingBackend(step=4)
    await model.register(backend)
    groups = [
        art.TrajectoryGroup([art.Trajectory(reward=1.0, metrics={"turns": 2}), art.Trajectory(reward=0.0)]),
        art.TrajectoryGroup([art.Trajectory(reward=0.5), RuntimeError("lost")]),
    ]
    await model.log(groups)
    await model.log(metrics={"loss": 0.25, "time/step_s": 3.0}, split="train", step=5)
    await model.log([art.Trajectory(reward=2.0)], split="test")  # bare trajectories form one group
    rows = [json.loads(line) for line in store(model).history.read_text().splitlines()]
    assert rows[0]["step"] == 4 and "recorded_at" in rows[0]
    assert rows[0]["val/reward"] == pytest.approx(0.5)
    assert rows[0]["val/exception_rate"] == pytest.approx(0.25)
    assert rows[0]["val/reward_std_dev"] == pytest.approx(0.5)  # only the group of two varies
    assert rows[0]["val/turns"] == 2
    assert {k: v for k, v in rows[1].items() if k != "recorded_at"} == {
        "train/loss": 0.25,
        "time/step_s": 3.0,
        "step": 5,
    }
    assert rows[2]["test/reward"] == 2.0
    assert [c for c in backend.calls if c[0] == "log"] == [("log", (2, "val")), ("log", (1, "test"))]


def write_history(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


async def registered_with_checkpoints(model: art.TrainableModel, latest: int) -> ProtocolBackend:
    backend = ProtocolBackend(step=latest)
    await model.register(backend)
    for step in range(latest + 1):
        folder = store(model).checkpoint_dir(step)
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"x")
    return backend


def remaining_checkpoints(model: art.TrainableModel) -> list[int]:
    return sorted(int(p.name) for p in store(model).checkpoints_dir.iterdir())


async def test_delete_checkpoints_keeps_latest_and_best(model):
    backend = await registered_with_checkpoints(model, latest=5)
    write_history(
        store(model).history,
        [
            {"step": 1, "val/reward": 0.2},
            {"step": 2, "val/reward": 0.9},
            {"step": 2, "val/reward": 0.5},  # step 2 means 0.7
            {"step": 3, "val/reward": 0.8},
            {"step": 3, "train/loss": 0.1},  # rows without the metric are ignored
            {"step": 4, "val/reward": None},
            {"step": 5, "val/reward": 0.1},
        ],
    )
    await model.delete_checkpoints()
    assert backend.calls[-1] == ("delete", [3, 5])
    assert remaining_checkpoints(model) == [3, 5]


async def test_delete_checkpoints_by_another_metric_and_ties_favour_the_later_step(model):
    await registered_with_checkpoints(model, latest=4)
    write_history(
        store(model).history,
        [{"step": 1, "val/solved": 1.0}, {"step": 2, "val/solved": 1.0}, {"step": 3, "val/solved": 0.0}],
    )
    await model.delete_checkpoints(best_checkpoint_metric="val/solved")
    assert remaining_checkpoints(model) == [2, 4]


async def test_delete_checkpoints_without_history_or_metric_keeps_only_the_latest(model, caplog):
    backend = await registered_with_checkpoints(model, latest=2)
    await model.delete_checkpoints()
    assert backend.calls[-1] == ("delete", [2]) and "not found" in caplog.text
    write_history(store(model).history, [{"step": 1, "train/loss": 0.3}])
    await model.delete_checkpoints()
    assert "no 'val/reward'" in caplog.text
    assert remaining_checkpoints(model) == [2]
