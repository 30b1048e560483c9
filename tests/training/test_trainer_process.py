"""TrainerProcess with the real worker subprocess: resume continues the optimizer exactly, bad input
changes nothing, the worker's stdout carries only protocol lines, a dead worker is a TrainerError, and a
saved adapter gives the same greedy output in peft and in the reference engine."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from training_helpers import Scorer, make_choice, trajectory

from art_sglang import named_tensors, weight_group
from art_sglang.config import SGLangConfig, TrainerConfig
from art_sglang.errors import ServerRequestError, TrainerError, TrainingInputError
from art_sglang.serving.servers.client import ServerClient
from art_sglang.serving.servers.process import ServerProcess
from art_sglang.storage.checkpoints import list_checkpoints
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess
from art_sglang.training.worker import _LongLivedObjects
from art_sglang.trajectories import TrajectoryGroup

OPTIONS = TrainOptions(learning_rate=5e-2)


def groups(tokenizer: Any, seed: int) -> list[TrajectoryGroup]:
    answers = [("1 2 3", 1.0), ("a b", 0.0), (f"{seed} z", 0.5)]
    return [
        TrajectoryGroup(
            [trajectory(f"task {seed} {g}", make_choice(tokenizer, a, [-7.0] * 5), r) for a, r in answers]
        )
        for g in range(2)
    ]


def trainer(model: Path, folder: Path, **config: Any) -> TrainerProcess:
    return TrainerProcess(
        str(model),
        folder / "checkpoints",
        TrainerConfig(**config),
        gpu_ids=None,
        log_path=folder / "trainer.log",
    )


async def test_resume_continues_adapter_and_optimizer(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    straight = trainer(tiny_model_path, tmp_path / "a")
    try:
        assert await straight.start() == 0
        await straight.train(groups(tokenizer, 1), OPTIONS)
        expected = await straight.train(groups(tokenizer, 2), OPTIONS)
    finally:
        await straight.stop()

    first = trainer(tiny_model_path, tmp_path / "b")
    try:
        await first.start()
        await first.train(groups(tokenizer, 1), OPTIONS)
    finally:
        await first.stop()
    resumed = trainer(tiny_model_path, tmp_path / "b")
    try:
        assert await resumed.start() == 1
        assert resumed.info["resumed"] is True
        await resumed.offload()  # CPU: answered, nothing to move
        await resumed.reload()
        got = await resumed.train(groups(tokenizer, 2), OPTIONS)
    finally:
        await resumed.stop()

    assert got.step == expected.step == 2
    # Same weights and same Adam moments before step 2 -> the same step 2, to float precision.
    for key in ("loss", "grad_norm", "ratio_mean", "clip_fraction"):
        assert got.metrics[key] == pytest.approx(expected.metrics[key], rel=1e-5), key
    a, b = (
        load_file(expected.checkpoint_path / "adapter_model.safetensors"),
        load_file(got.checkpoint_path / "adapter_model.safetensors"),
    )
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7)
    opt_a = torch.load(expected.checkpoint_path / "optimizer.pt")["state"]
    opt_b = torch.load(got.checkpoint_path / "optimizer.pt")["state"]
    assert opt_a.keys() == opt_b.keys() and len(opt_a) > 0
    for index in opt_a:
        assert float(opt_a[index]["step"]) == float(opt_b[index]["step"]) == 2.0
        torch.testing.assert_close(opt_b[index]["exp_avg"], opt_a[index]["exp_avg"], rtol=1e-5, atol=1e-9)
    state = json.loads((got.checkpoint_path / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["metrics"]["loss"] == pytest.approx(got.metrics["loss"])


async def test_bad_input_changes_nothing(tiny_model_path: Path, tmp_path: Path, tokenizer: Any) -> None:
    proc = trainer(tiny_model_path, tmp_path)
    try:
        await proc.start()
        folder = tmp_path / "checkpoints"
        before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
        good = groups(tokenizer, 3)
        nan = [*good, TrajectoryGroup([trajectory("q", make_choice(tokenizer, "1"), float("nan"))])]
        with pytest.raises(TrainingInputError, match="group 2, trajectory 0: reward must be a finite number"):
            await proc.train(nan, OPTIONS)
        # Checked only by the worker (needs the model): token ids within the vocabulary.
        alien = make_choice(tokenizer, "1 2")
        # The ids the server sampled, one per logprob entry, the last from another vocabulary.
        alien.token_ids = [5] * (len(alien.logprobs.content) - 1) + [10**6]
        foreign = [*good, TrajectoryGroup([trajectory("q", alien, 1.0)])]
        with pytest.raises(
            TrainingInputError,
            match=r"group 2, trajectory 0: token id 1000000 is outside the model's vocabulary",
        ):
            await proc.train(foreign, OPTIONS)
        assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before
        assert list_checkpoints(folder) == [0]
        # The worker is still healthy and the step number unchanged.
        events: list[dict[str, Any]] = []
        outcome = await proc.train(good, OPTIONS, on_progress=events.append)
        assert outcome.step == 1 and list_checkpoints(folder) == [0, 1]
        assert events and events[-1]["micro_batch"] == events[-1]["micro_batches"]
    finally:
        await proc.stop()


async def test_dead_worker_is_a_trainer_error(tiny_model_path: Path, tmp_path: Path, tokenizer: Any) -> None:
    proc = trainer(tiny_model_path, tmp_path)
    try:
        await proc.start()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(TrainerError, match=r"(?s)trainer worker .*exit code -9.*trainer\.log"):
            await proc.train(groups(tokenizer, 1), OPTIONS)
    finally:
        await proc.stop()
    assert not proc.is_alive()
    with pytest.raises(TrainerError, match="not running"):
        await proc.train(groups(tokenizer, 1), OPTIONS)


async def test_a_worker_left_in_the_broadcast_of_a_failed_push_is_stopped(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A push over a weight-update group whose server fails a bucket: a worker whose broadcast went through
    ends the push and goes on; one whose broadcast nobody receives (a server that failed before it joined:
    NCCL then waits for ever) is stopped `settle_s` after the failure, not left holding the trainer."""
    proc = trainer(tiny_model_path, tmp_path)

    async def join(name: str) -> Any:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        _, group = await asyncio.gather(
            proc.join_update_group("127.0.0.1", port, 2, name, "gloo", 300.0),
            asyncio.to_thread(
                weight_group.join, "127.0.0.1", port, 1, 2, name, backend="gloo", timeout_s=300.0
            ),
        )
        return group

    async def fail_after_receiving(bucket: dict[str, Any], last: bool, step: int) -> bool:
        empty = [
            (n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(*bucket.values(), strict=True)
        ]
        await asyncio.to_thread(
            weight_group.broadcast, group, named_tensors.flatten(empty)["flattened_tensor"]
        )
        raise ServerRequestError("the server failed the bucket after receiving it")

    async def fail_at_once(bucket: dict[str, Any], last: bool, step: int) -> bool:
        raise ServerRequestError("the server failed the bucket before receiving it")

    try:
        await proc.start()
        group = await join("received")
        with pytest.raises(ServerRequestError, match="after receiving"):
            await proc.push_merged(
                fail_after_receiving, max_bytes=1 << 16, load_format=None, group_name="received"
            )
        weight_group.leave(group)
        assert proc.is_alive() and proc.update_group is None
        group = await join("never-received")
        started = time.monotonic()
        with pytest.raises(ServerRequestError, match="before receiving"):
            await proc.push_merged(
                fail_at_once, max_bytes=1 << 16, load_format=None, group_name="never-received", settle_s=3.0
            )
        assert 3.0 <= time.monotonic() - started < 60.0
        assert not proc.is_alive()
    finally:
        await proc.stop()


def test_handle_works_across_event_loops(tiny_model_path: Path, tmp_path: Path, tokenizer: Any) -> None:
    # As with a sync fixture: started under one asyncio.run, used under the next ones.
    proc = trainer(tiny_model_path, tmp_path)
    try:
        assert asyncio.run(proc.start()) == 0
        assert asyncio.run(proc.train(groups(tokenizer, 1), OPTIONS)).step == 1
        assert asyncio.run(proc.start()) == 1  # already running: the step it reached
    finally:
        asyncio.run(proc.stop())
    assert not proc.is_alive()


async def test_failing_start_reports_the_log(tmp_path: Path) -> None:
    proc = trainer(tmp_path / "no-such-model", tmp_path)
    with pytest.raises(TrainerError, match="no-such-model"):
        await proc.start()
    assert not proc.is_alive()


def test_cuda_devices_are_set_for_the_child(tiny_model_path: Path, tmp_path: Path) -> None:
    env = TrainerProcess(
        str(tiny_model_path), tmp_path, TrainerConfig(), gpu_ids=[3, 5], log_path=tmp_path / "l"
    ).environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"


def test_worker_stdout_carries_only_protocol_lines(tiny_model_path: Path, tmp_path: Path) -> None:
    requests = [
        {
            "id": 1,
            "cmd": "init",
            "base_model": str(tiny_model_path),
            "checkpoint_dir": str(tmp_path / "c"),
            "config": {},
        },
        {"id": 2, "cmd": "bogus"},
        {"id": 3, "cmd": "shutdown"},
    ]
    env = TrainerProcess(
        str(tiny_model_path), tmp_path, TrainerConfig(), gpu_ids=None, log_path=tmp_path / "l"
    ).environment()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "print('noise'); import runpy; runpy.run_module('art_sglang.training.worker', run_name='__main__')",
        ],
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [
        json.loads(line) for line in done.stdout.splitlines()[1:]
    ]  # line 0 is the noise printed before the worker
    assert [(m["id"], m["event"]) for m in lines] == [(1, "result"), (2, "error"), (3, "result")]
    assert lines[0]["data"]["step"] == 0 and lines[1]["message"] == "RuntimeError: unknown command 'bogus'"
    assert "Loading weights" in done.stderr  # library output went to stderr


async def test_the_loaded_model_and_the_first_step_are_frozen_once(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    """What the load and the first step leave is exempt from later full collections (one walked ~0.7 M
    objects in 0.5 s on CPU; inside a step it stalls every rank at the next collective), and nothing
    later is frozen: the freeze count stays what the first step left."""
    proc = trainer(tiny_model_path, tmp_path)
    try:
        await proc.start()
        for seed in range(3):
            await proc.train(groups(tokenizer, seed), OPTIONS)
    finally:
        await proc.stop()
    frozen = re.findall(
        r"^garbage collector: (\d+) objects frozen after the first (\w+)", proc.log_path.read_text(), re.M
    )
    assert [cmd for _, cmd in frozen] == ["init", "train"]
    (after_load, _), (after_step, _) = frozen
    assert 100_000 < int(after_load) <= int(after_step)


def test_garbage_made_after_the_freezes_is_still_collected() -> None:
    class Node:
        pass

    long_lived = _LongLivedObjects()
    before = gc.get_freeze_count()
    try:
        long_lived.freeze_after("init")
        frozen = gc.get_freeze_count()
        assert frozen > before
        node = Node()
        node.self = node  # a cycle: only the collector reclaims it
        alive = weakref.ref(node)
        for cmd in ("init", "offload", "reload"):  # not a moment, or one already passed
            long_lived.freeze_after(cmd)
        assert gc.get_freeze_count() == frozen
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


async def test_adapter_round_trip_peft_and_reference_engine(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    proc = trainer(tiny_model_path, tmp_path)
    try:
        await proc.start()
        for seed in range(3):
            outcome = await proc.train(groups(tokenizer, seed), TrainOptions(learning_rate=1e-1))
    finally:
        await proc.stop()
    adapter = outcome.checkpoint_path
    assert adapter is not None
    weights = load_file(adapter / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert any(float(v.abs().max()) > 0 for k, v in weights.items() if ".lora_B." in k)
    prompt = "task 1 0"
    peft = Scorer(tiny_model_path, adapter)
    base_ids = Scorer(tiny_model_path).greedy(prompt)
    peft_ids = peft.greedy(prompt)
    assert peft_ids != base_ids  # the adapter changes the model
    expected = tokenizer.decode(peft_ids, skip_special_tokens=True)

    server = ServerProcess(
        SGLangConfig(max_lora_rank=8, server_timeout=120),
        str(tiny_model_path),
        engine="reference",
        log_path=tmp_path / "server.log",
    )
    await server.start()
    try:
        async with ServerClient(server.base_url) as client:
            await client.load_lora_adapter("m@3", str(adapter))
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                response = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m@3",
                        "lora_path": "m@3",  # SGLang 0.5.17 serves a bare model name with the base model
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": len(peft_ids),
                        "temperature": 0,
                    },
                )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == expected
    finally:
        await server.stop()
