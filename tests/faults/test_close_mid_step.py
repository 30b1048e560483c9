"""`close()` while a step trains and rollouts run, on real processes: a rollout the stopped server ended
unfinished reaches its client as an error (SGLang, and the reference engine, end it with HTTP 200 and
finish_reason "abort", which ART's gather would count as a success), and the train() in flight says the
backend was closed rather than that its trainer died."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_helpers import kill_tree, sample_groups

import art_sglang as art
from art_sglang import SGLangBackend, TrainerError

TRAIN = {"learning_rate": 1e-3, "allow_training_without_logprobs": True}


async def _rollout(gateway: str, model: str, stream: bool) -> str:
    """A long rollout, told as what its client got: 'success', 'aborted' (200 with finish_reason abort),
    'HTTP <status>' or the transport error's name."""
    body = {"model": model, "messages": [{"role": "user", "content": "count"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    try:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            response = await http.post(f"{gateway}/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if response.status_code != 200:
        return f"HTTP {response.status_code}"
    return "aborted" if '"abort"' in response.text else "success"


async def test_close_during_a_step_fails_its_rollouts_and_says_the_backend_was_closed(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    backend = SGLangBackend(path=str(tmp_path / ".art"))
    model = art.TrainableModel(name="agent", project="close", base_model=str(tiny_model_path))
    await model.register(backend)
    try:
        assert model.inference_base_url is not None and backend.inference is not None
        gateway = model.inference_base_url.removesuffix("/v1")
        groups = await sample_groups(model, seed=1)
        trainer = backend.trainer(model)
        real_train = trainer.train

        async def train_that_never_ends(*args: Any, **kwargs: Any) -> Any:
            kill_tree(trainer.pid, signal.SIGSTOP)  # the step is under way until close() ends it
            return await real_train(*args, **kwargs)

        trainer.train = train_that_never_ends  # type: ignore[method-assign]
        step = asyncio.create_task(backend.train(model, groups, **TRAIN))
        name = model.get_inference_name()
        rollouts = [asyncio.create_task(_rollout(gateway, name, stream)) for stream in (False, True) * 2]
        gw = backend.inference.gateway
        assert gw is not None
        while gw.in_flight() < len(rollouts):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the first one generates
    finally:
        await asyncio.wait_for(backend.close(), timeout=120)
    outcomes = await asyncio.gather(*rollouts)
    assert "success" not in outcomes and "aborted" not in outcomes, outcomes
    with pytest.raises(TrainerError, match="backend was closed"):
        await step
