"""Faults on real SGLang, in split mode (server on GPU 0, trainer on GPU 1) and shared mode (one GPU, the
`sleep` handoff). One backend per mode; the tests run in order against it:

a first step gives an adapter that differs from the base model -> the server process is SIGKILLed while
the trainer works and rollouts keep going: only requests in flight may fail, later ones wait for the
restarted server and are answered by the right adapter, train() completes and its step is served -> a
fault between steps (split: the whole server tree SIGKILLed; shared: SIGSTOPped, i.e. hung) is detected,
the server restarted with the current adapter, and the next step trains and is served. After each fault
no process outside the backend's live tree holds GPU memory.

    pytest -m gpu tests/gpu/test_parent_kill.py tests/gpu/test_faults.py -k split    (2 GPUs)
    pytest -m gpu tests/gpu/test_parent_kill.py tests/gpu/test_faults.py -k shared   (1 GPU)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
from gpu_helpers import (
    generate,
    input_logprobs,
    make_groups,
    random_token_ids,
    record,
    server_pids,
    sglang_test_config,
)

from art_sglang import SGLangBackend, TrainableModel
from art_sglang.process_tree import collect_tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from backend_helpers import chat

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

LEARNING_RATE = 0.02  # moves a random tiny model's logprobs clearly (see test_shared_mode.py)
# A hung server is restarted after this long without an answer to GET /health (default 120 s).
UNRESPONSIVE_S = 5.0
# Served logprobs of one fixed sequence, same adapter, same kernels, before and after a server restart:
# they differ only by bf16 noise (SGLang vs the trainer, other kernels, differ by ~0.001 on average). A
# step at LEARNING_RATE moves them ~0.1 on average from the base model.
SAME_ADAPTER_MEAN_ABS = 0.01
BETWEEN_STEPS_FAULT = {"split": signal.SIGKILL, "shared": signal.SIGSTOP}
ROLLOUT_WORKERS = 8


@dataclass
class Run:
    mode: str
    backend: SGLangBackend
    model: TrainableModel
    probe_ids: list[int]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def gateway_url(self) -> str:
        assert self.model.inference_base_url is not None
        return self.model.inference_base_url.removesuffix("/v1")

    @property
    def server_pid(self) -> int:
        service = self.backend.inference
        assert service is not None and service.process.pid is not None
        return service.process.pid


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["split", "shared"])
async def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gpu_model: str,
              gpu_count: int):  # fmt: skip
    from transformers import AutoConfig

    mode = request.param
    if mode == "split" and gpu_count < 2:
        pytest.skip(f"split mode needs 2 GPUs, {gpu_count} visible")
    root = tmp_path_factory.mktemp(f"faults-{mode}")
    backend = SGLangBackend(
        engine="sglang",
        inference_device=0,
        training_devices=[1] if mode == "split" else [0],
        sglang_config=sglang_test_config(unresponsive_timeout=UNRESPONSIVE_S),
        path=str(root / ".art"),
    )
    model = TrainableModel(name="agent", project=f"gpu-faults-{mode}", base_model=gpu_model)
    vocab = AutoConfig.from_pretrained(gpu_model).vocab_size
    try:
        await model.register(backend)
        yield Run(mode, backend, model, random_token_ids(48, vocab, seed=11))
    finally:
        await backend.close()


async def _served_logprobs(run: Run, name: str | None) -> list[float]:
    """Input logprobs of the fixed probe sequence on adapter `name` (None: the base model), as served."""
    return input_logprobs(await generate(run.gateway_url, run.probe_ids, lora=name))


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    for proc in collect_tree(pid):
        proc.send_signal(sig)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_a_first_step_moves_the_adapter_away_from_the_base_model(run: Run) -> None:
    client = run.model.openai_client()
    groups = await make_groups(client, "agent@0")
    result = await run.backend.train(run.model, groups, learning_rate=LEARNING_RATE)
    assert result.step == 1 and run.model.get_inference_name() == "agent@1"
    reference = await _served_logprobs(run, "agent@1")
    base = await _served_logprobs(run, None)
    run.facts["reference"] = reference
    assert _mean_abs(reference, base) > 3 * SAME_ADAPTER_MEAN_ABS, "the step-1 adapter is the base model"
    record(f"faults-{run.mode}/first-step", adapter_vs_base_mean_abs=_mean_abs(reference, base))


async def test_server_killed_during_train_recovers_with_the_right_adapter(run: Run) -> None:
    backend, model = run.backend, run.model
    groups = await make_groups(model.openai_client(), "agent@1")
    trainer = backend.trainer(model)
    real_train = trainer.train
    killed: dict[str, Any] = {}

    async def train_while_the_server_dies(*args: Any, **kwargs: Any):
        # SIGKILL to the server's main process only, as the OOM killer would send it: its scheduler and
        # detokenizer children (which hold the GPU memory) must not outlive it into the restart.
        killed["pid"] = run.server_pid
        killed["tree"] = [p.pid for p in collect_tree(killed["pid"])]
        killed["at"] = time.monotonic()
        psutil.Process(killed["pid"]).send_signal(signal.SIGKILL)
        return await real_train(*args, **kwargs)

    results: list[tuple[float, float, int]] = []  # (sent, answered, HTTP status or -1)
    stop = asyncio.Event()

    async def rollouts() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = (await chat(run.gateway_url, model.get_inference_name(), max_tokens=8)).status_code
            except Exception:  # the connection broke mid-response
                status = -1
            results.append((sent, time.monotonic(), status))

    workers = [asyncio.create_task(rollouts()) for _ in range(ROLLOUT_WORKERS)]
    await asyncio.sleep(1.0)  # rollouts in flight when the server dies
    trainer.train = train_while_the_server_dies  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        result = await backend.train(model, groups, learning_rate=LEARNING_RATE)
    finally:
        del trainer.train
        returned = time.monotonic()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*workers)

    assert result.step == 2 and model.get_inference_name() == "agent@2"
    failed = [(sent, status) for sent, _, status in results if status != 200]
    # Only requests already sent when the server died may fail; every later one waited and succeeded.
    assert all(sent < killed["at"] for sent, _ in failed), failed[:5]
    assert len(failed) <= ROLLOUT_WORKERS
    waited = [answered for sent, answered, status in results if sent > killed["at"] and status == 200]
    assert waited, "no rollout sent after the kill was answered"
    assert not any(map(_running, killed["tree"])), "a process of the killed server still runs"
    # The killed server's whole tree (collected just before the kill) is checked above; processes of other
    # runs on the machine (suites run two at a time, one per GPU) are none of this test's business.
    assert run.server_pid != killed["pid"]
    # The restarted server serves step 1 with step 1's adapter, and the new step.
    after = await _served_logprobs(run, "agent@1")
    assert _mean_abs(after, run.facts["reference"]) < SAME_ADAPTER_MEAN_ABS
    assert (await chat(run.gateway_url, "agent@2")).status_code == 200
    record(
        f"faults-{run.mode}/server-killed-during-train",
        requests=len(results),
        failed=len(failed),
        failed_statuses=sorted({status for _, status in failed}),
        answered_after_kill=len(waited),
        longest_wait_s=max(answered - sent for sent, answered, _ in results),
        train_call_s=returned - started,
        same_adapter_mean_abs=_mean_abs(after, run.facts["reference"]),
        metrics={k: v for k, v in result.metrics.items() if k.startswith("time/")},
    )


async def test_server_fault_between_steps_is_recovered_and_the_next_step_works(run: Run) -> None:
    fault = BETWEEN_STEPS_FAULT[run.mode]
    name = run.model.get_inference_name()
    before = await _served_logprobs(run, name)
    pid = run.server_pid
    tree = [p.pid for p in collect_tree(pid)]
    faulted = time.monotonic()
    _signal_tree(pid, fault)
    # Sent to the broken server: a stopped one holds it until the watchdog kills it (then it fails once);
    # a dead one makes it wait in the gateway for the restart.
    reply = await chat(run.gateway_url, name)
    first_status = reply.status_code
    if reply.status_code != 200 and fault == signal.SIGSTOP:
        reply = await chat(run.gateway_url, name)
    recovered = time.monotonic()
    assert reply.status_code == 200, reply.text
    assert run.server_pid != pid
    assert not any(map(_running, tree)), "a process of the faulted server still runs"
    after = await _served_logprobs(run, name)
    assert _mean_abs(after, before) < SAME_ADAPTER_MEAN_ABS

    step = await run.model.get_step()
    groups = await make_groups(run.model.openai_client(), name)
    result = await run.backend.train(run.model, groups, learning_rate=LEARNING_RATE)
    assert result.step == step + 1 and run.model.get_inference_name() == f"agent@{step + 1}"
    assert (await chat(run.gateway_url, f"agent@{step + 1}")).status_code == 200
    assert server_pids()
    record(
        f"faults-{run.mode}/server-{fault.name}-between-steps",
        first_request_status=first_status,
        recovered_after_s=recovered - faulted,
        same_adapter_mean_abs=_mean_abs(after, before),
        metrics={k: v for k, v in result.metrics.items() if k.startswith("time/")},
    )
