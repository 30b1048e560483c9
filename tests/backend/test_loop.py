"""The whole loop on CPU: register -> rollouts through model.openai_client() -> three train steps with
LoRA hot-loading, the adapter keep-count, history, log(), checkpoint deletion, the gateway's refusal of
unloaded names, requests in flight during a hot-load, input errors that change nothing on disk, and a
resume in a new process. One backend (reference engine + trainer worker) for the whole module; the tests
run in order."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import pytest_asyncio
from backend_helpers import REPO, bearer, chat, kill_tree, sample_groups, server_models, tree_snapshot

import art_sglang as art
from art_sglang import ConfigError, SGLangBackend, SGLangConfig, TrainingError, TrainingInputError
from art_sglang.storage.history import read_rows
from art_sglang.storage.model_store import ModelStore

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEEP = 2


@dataclass
class Loop:
    backend: SGLangBackend
    model: art.TrainableModel
    store: ModelStore
    path: Path

    @property
    def server_url(self) -> str:
        assert self.backend.inference is not None
        return self.backend.inference.process.base_url

    @property
    def server_key(self) -> str | None:
        assert self.backend.inference is not None
        return self.backend.inference.process.config.api_key

    @property
    def gateway_url(self) -> str:
        assert self.model.inference_base_url is not None
        return self.model.inference_base_url.removesuffix("/v1")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def loop(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    path = tmp_path_factory.mktemp("loop") / ".art"
    backend = SGLangBackend(path=str(path), sglang_config=SGLangConfig(adapters_to_keep=KEEP))
    model = art.TrainableModel(name="agent", project="loop", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield Loop(backend, model, ModelStore(path, "loop", "agent"), path)
    finally:
        await backend.close()


async def test_register_serves_step_zero_and_writes_the_layout(loop: Loop) -> None:
    assert loop.backend.layout.mode == "cpu" and loop.backend.layout.engine == "reference"
    assert loop.model.get_inference_name() == "agent@0"
    assert await loop.model.get_step() == 0
    listed = {m.id for m in (await loop.model.openai_client().models.list()).data}
    assert "agent@0" in listed
    saved = json.loads(loop.store.model_json.read_text())
    assert saved["name"] == "agent" and saved["base_model"] == loop.model.base_model
    assert loop.store.checkpoint_steps() == [0]
    assert loop.store.server_log.stat().st_size > 0 and loop.store.trainer_log.exists()
    # Registering again changes nothing.
    await loop.model.register(loop.backend)
    assert loop.model.get_inference_name() == "agent@0"


async def test_unloaded_name_is_404_through_the_gateway_but_base_model_200_on_the_server(loop: Loop) -> None:
    direct = await chat(loop.server_url, "agent@7", key=loop.server_key)
    assert direct.status_code == 200 and direct.json()["model"] == "agent@7"  # the trap
    refused = await chat(loop.gateway_url, "agent@7")
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert (
        error["code"] == "model_not_found" and "agent@7" in error["message"] and "agent@0" in error["message"]
    )
    with pytest.raises(openai.NotFoundError, match="agent@7"):
        await loop.model.openai_client().chat.completions.create(
            model="agent@7", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    # The base model stays reachable on purpose (asked for by its own id), streaming included.
    base = await chat(loop.gateway_url, loop.model.base_model, stream=True)
    assert base.status_code == 200 and b"data: [DONE]" in base.content


async def test_rollout_clients_hold_no_key_of_the_server(loop: Loop) -> None:
    """The key rollouts get opens the gateway only: the server's ordinary routes want the gateway's own
    key, its admin routes yet another one, and no key is on the server's command line."""
    service = loop.backend.inference
    assert service is not None and service.process.pid is not None
    rollout_key, server_key = loop.model.inference_api_key, loop.server_key
    assert server_key and rollout_key != server_key
    assert (await chat(loop.gateway_url, "agent@0")).status_code == 200
    assert (await chat(loop.server_url, "agent@0", key=rollout_key)).status_code == 401
    assert (await chat(loop.server_url, "agent@0", key=server_key)).status_code == 200
    async with httpx.AsyncClient(base_url=loop.server_url, timeout=30, trust_env=False) as http:
        for key in (rollout_key, server_key):
            refused = await http.post(
                "/unload_lora_adapter", json={"lora_name": "agent@0"}, headers=bearer(key)
            )
            assert refused.status_code == 401
    assert "agent@0" in await server_models(loop.server_url, server_key)
    command = " ".join(psutil.Process(service.process.pid).cmdline())
    assert server_key not in command and "--config" in command


async def test_three_steps_hot_load_and_keep_the_newest_adapters(loop: Loop) -> None:
    for step in (1, 2, 3):
        groups = await sample_groups(loop.model, seed=step)
        result = await loop.backend.train(
            loop.model, groups, learning_rate=1e-3, allow_training_without_logprobs=True
        )
        assert result.step == step and await loop.model.get_step() == step
        assert loop.model.get_inference_name() == f"agent@{step}"
        for key in ("time/train_s", "time/sync_s", "time/probe_s", "loss", "reward"):
            assert key in result.metrics, key
        # What the gateway's prefill sharing did for this step's rollouts (counts, never negative).
        shared = {key: value for key, value in result.metrics.items() if key.startswith("rollout/")}
        assert set(shared) == {
            "rollout/requests_held",
            "rollout/prefill_requests",
            "rollout/prefill_tokens_saved",
            "rollout/prefill_failures",
            "rollout/requests_alone",
        }
        assert all(isinstance(value, int) and value >= 0 for value in shared.values())
        on_server = {
            name
            for name in await server_models(loop.server_url, loop.server_key)
            if name.startswith("agent@")
        }
        assert on_server == {f"agent@{s}" for s in range(max(0, step - KEEP + 1), step + 1)}
        assert (await chat(loop.gateway_url, f"agent@{step}")).status_code == 200
        if step >= KEEP:
            assert f"agent@{step - KEEP}" not in on_server
    assert loop.store.checkpoint_steps() == [0, 1, 2, 3]
    rows = [row for row in read_rows(loop.store.history) if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["time/train_s"] > 0 for row in rows)


async def test_an_older_step_on_disk_is_loaded_on_request(loop: Loop) -> None:
    older = loop.model.get_inference_name(step=1)
    assert older == "agent@1" and older not in await server_models(loop.server_url, loop.server_key)
    assert (await chat(loop.gateway_url, older)).status_code == 200
    assert older in await server_models(loop.server_url, loop.server_key)
    missing = await chat(loop.gateway_url, loop.model.get_inference_name(step=99))
    assert missing.status_code == 404 and "No checkpoint of that step is on disk" in missing.text
    # The next sync's keep-count unloads it again (the newest steps stay).
    current = await loop.model.get_step()
    await loop.backend.train(
        loop.model,
        await sample_groups(loop.model, seed=9),
        learning_rate=1e-3,
        allow_training_without_logprobs=True,
    )
    listed = {
        name for name in await server_models(loop.server_url, loop.server_key) if name.startswith("agent@")
    }
    assert listed == {f"agent@{current}", f"agent@{current + 1}"}


async def test_requests_in_flight_during_a_hot_load_all_complete(loop: Loop) -> None:
    before = await loop.model.get_step()
    name = loop.model.get_inference_name()
    groups = await sample_groups(loop.model, seed=11)

    async def one(i: int) -> int:
        await asyncio.sleep(0.02 * (i % 10))  # spread over the whole train() call
        response = await chat(loop.gateway_url, name, max_tokens=24, stream=i % 2 == 0)
        assert b"error" not in response.content[-200:], response.content[-200:]
        return response.status_code

    requests = [asyncio.create_task(one(i)) for i in range(16)]
    result = await loop.backend.train(
        loop.model, groups, learning_rate=1e-3, allow_training_without_logprobs=True
    )
    statuses = await asyncio.gather(*requests)
    assert statuses == [200] * 16
    assert result.step == before + 1
    # The name the requests used is still served: it is within the keep-count.
    assert (await chat(loop.gateway_url, name)).status_code == 200


async def test_bad_input_fails_before_training_and_changes_nothing(loop: Loop) -> None:
    step = await loop.model.get_step()
    saved = tree_snapshot(loop.store.checkpoints_dir)
    history = loop.store.history.read_text()
    no_choice = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=r)
            for r in (0.0, 1.0)
        ]
    )
    with pytest.raises(TrainingInputError, match=r"no trajectory of any group has an assistant Choice"):
        await loop.backend.train(loop.model, [no_choice])
    with pytest.raises(TrainingInputError, match="no trajectory groups"):
        await loop.backend.train(loop.model, [])
    with pytest.raises(TrainingInputError, match="group 0 is a list"):
        await loop.backend.train(loop.model, [[1, 2]])
    with pytest.raises(TrainingInputError, match=r"got NoneType: pass what gather_trajectory_groups"):
        await loop.backend.train(loop.model, None)  # type: ignore[arg-type]
    good = await sample_groups(loop.model, seed=5, groups=1)
    nan = good[0].trajectories[0].model_copy(update={"reward": float("nan")})
    with pytest.raises(TrainingInputError, match="reward must be a finite number"):
        await loop.backend.train(loop.model, [art.TrajectoryGroup([nan, *good[0].trajectories[1:]])])
    with pytest.raises(ConfigError, match="plot_tensors=True is not supported"):
        await loop.backend.train(loop.model, good, plot_tensors=True)
    with pytest.raises(
        ConfigError, match=r"packed_sequence_length=65536 exceeds TrainerConfig\(max_seq_length"
    ):
        await loop.backend.train(loop.model, good, packed_sequence_length=65536)
    with pytest.raises(ConfigError, match="adam_params"):
        await loop.backend.train(loop.model, good, adam_params={"lr": 1.0})
    assert await loop.model.get_step() == step
    assert tree_snapshot(loop.store.checkpoints_dir) == saved
    assert loop.store.history.read_text() == history
    assert (await chat(loop.gateway_url, loop.model.get_inference_name())).status_code == 200


async def test_equal_rewards_advance_the_step_and_serve_it(
    loop: Loop, caplog: pytest.LogCaptureFixture
) -> None:
    # As ART: no optimizer step, but a new step (a copy of the last checkpoint), served like any other.
    step = await loop.model.get_step()
    groups = await sample_groups(loop.model, seed=7, groups=1)
    flat = art.TrajectoryGroup([t.model_copy(update={"reward": 0.5}) for t in groups[0].trajectories])
    with caplog.at_level(logging.WARNING, logger="art_sglang.backend"):
        result = await loop.backend.train(loop.model, [flat], allow_training_without_logprobs=True)
        again = await loop.backend.train(loop.model, [flat], allow_training_without_logprobs=True)
    assert result.step == step + 1 and again.step == step + 2 and await loop.model.get_step() == step + 2
    assert result.metrics["groups_skipped"] == 1.0 and result.metrics["gradient_steps"] == 0.0
    assert loop.model.get_inference_name() == f"agent@{step + 2}"
    assert (await chat(loop.gateway_url, f"agent@{step + 1}")).status_code == 200
    assert result.checkpoint_path == str(loop.store.checkpoint_dir(step + 1))
    # Said once for the run of steps without signal, in words that say what it means.
    warnings = [r.getMessage() for r in caplog.records if "no optimizer step" in r.getMessage()]
    assert len(warnings) == 1 and "every rollout got the same reward" in warnings[0], warnings


async def test_a_poisoned_step_is_refused_and_nothing_moves(loop: Loop) -> None:
    step = await loop.model.get_step()
    served = loop.model.get_inference_name()
    saved = tree_snapshot(loop.store.checkpoints_dir)
    groups = await sample_groups(loop.model, seed=13, groups=1)
    for index, trajectory in enumerate(groups[0].trajectories):
        trajectory.reward = float(index)  # distinct rewards: the first has a negative advantage
    worst = groups[0].trajectories[0]
    choice = next(item for item in worst.messages_and_choices if not isinstance(item, dict))
    # A finite, plausible logprob that makes PPO's ratio overflow on a negative advantage.
    choice.logprobs.content[0].logprob = -900.0
    with pytest.raises(TrainingError, match=r"the loss is not finite"):
        await loop.backend.train(loop.model, groups, loss_fn="ppo", learning_rate=1e-3)
    assert await loop.model.get_step() == step and loop.model.get_inference_name() == served
    assert tree_snapshot(loop.store.checkpoints_dir) == saved
    assert (await chat(loop.gateway_url, served)).status_code == 200
    # history.jsonl stays JSON that any reader accepts, even with non-finite metrics logged.
    await loop.model.log(metrics={"custom": float("inf")}, split="train")
    rows = [
        json.loads(line, parse_constant=pytest.fail) for line in loop.store.history.read_text().splitlines()
    ]
    assert rows[-1]["train/custom"] is None
    result = await loop.backend.train(
        loop.model, await sample_groups(loop.model, seed=14), learning_rate=1e-3, save_checkpoint=False
    )
    assert result.step == step + 1 and result.checkpoint_path is None  # as ART: saved, just not reported
    assert loop.store.checkpoint_steps()[-1] == step + 1


async def test_log_records_history_and_trajectories(loop: Loop) -> None:
    groups = await sample_groups(loop.model, seed=21)
    await loop.model.log(groups, split="val")
    step = await loop.model.get_step()
    rows = [row for row in read_rows(loop.store.history) if "val/reward" in row]
    assert rows and rows[-1]["step"] == step
    stored = loop.store.trajectories_file("val", step).read_text().splitlines()
    assert len(stored) == len(groups)
    assert art.TrajectoryGroup.model_validate_json(stored[0]).trajectories[0].reward == pytest.approx(
        groups[0].trajectories[0].reward
    )


async def test_delete_checkpoints_keeps_latest_and_best_and_unloads_the_rest(loop: Loop) -> None:
    current = await loop.model.get_step()
    await loop.model.delete_checkpoints()  # best by val/reward: logged only at the current step
    assert loop.store.checkpoint_steps() == [current]
    on_server = {
        name for name in await server_models(loop.server_url, loop.server_key) if name.startswith("agent@")
    }
    assert on_server == {f"agent@{current}"}
    assert (await chat(loop.gateway_url, f"agent@{current}")).status_code == 200


async def test_a_second_model_shares_the_server_with_its_own_trainer(loop: Loop) -> None:
    mine = {n for n in await server_models(loop.server_url, loop.server_key) if n.startswith("agent@")}
    other = art.TrainableModel(name="other", project="loop", base_model=loop.model.base_model)
    await other.register(loop.backend)
    assert (
        other.get_inference_name() == "other@0" and other.inference_base_url == loop.model.inference_base_url
    )
    result = await loop.backend.train(
        other, await sample_groups(other, seed=31), learning_rate=1e-3, allow_training_without_logprobs=True
    )
    assert result.step == 1 and other.get_inference_name() == "other@1"
    listed = await server_models(loop.server_url, loop.server_key)
    assert {"other@0", "other@1"} <= listed and mine <= listed  # the keep-count is per model
    elsewhere = art.TrainableModel(name="third", project="loop", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ConfigError, match="one server serves one base model"):
        await elsewhere.register(loop.backend)
    assert not (loop.path / "loop" / "models" / "third").exists()  # refused before anything was written


async def test_a_crashed_server_comes_back_with_its_adapters(loop: Loop) -> None:
    service = loop.backend.inference
    assert service is not None
    name = loop.model.get_inference_name()
    crashed = kill_tree(service.process.pid)
    deadline = time.monotonic() + 120
    while not (service.process.is_alive() and service.process.pid != crashed):
        assert time.monotonic() < deadline, "the watchdog did not restart the server"
        await asyncio.sleep(0.2)
    # Ready means the current adapter is loaded: the first request on it succeeds.
    assert (await chat(loop.gateway_url, name)).status_code == 200
    assert name in await server_models(loop.server_url, loop.server_key)


RESUME = textwrap.dedent(
    """
    import asyncio, json, sys
    import art_sglang as art

    async def main(path, base):
        model = art.TrainableModel(name="agent", project="loop", base_model=base)
        async with art.SGLangBackend(path=path) as backend:
            await model.register(backend)
            reply = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            served = [m.id for m in (await model.openai_client().models.list()).data]
            print(json.dumps({"step": await model.get_step(), "name": model.get_inference_name(),
                              "served": served, "answered_by": reply.model}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_new_process_resumes_at_the_latest_step(loop: Loop) -> None:
    step = await loop.model.get_step()
    await loop.backend.close()
    await loop.backend.close()  # idempotent
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", RESUME, str(loop.path), loop.model.base_model],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["step"] == step and facts["name"] == f"agent@{step}"
    assert f"agent@{step}" in facts["served"] and facts["answered_by"] == f"agent@{step}"
