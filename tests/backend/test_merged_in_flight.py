"""Rollouts in flight across a merged-weight update (weight_sync_method="merged", CPU, reference engine):
the push aborts them and the gateway continues each on the new weights, so the client gets one complete
choice whose runs of tokens name the weights that sampled them (`art_weight_versions`) and whose every
token has the logprob it was sampled with; train() takes such a rollout within max_steps_off_policy and
refuses it beyond; the prefix cache is flushed with each update unless flush_cache_on_sync=False."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backend_helpers import choice_of_stream, sample_groups

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.errors import TrainingInputError
from art_sglang.serving.gateway.resend import VERSIONS_FIELD

LONG = 1500  # tokens: a rollout still running when the update comes
PROMPT = [{"role": "user", "content": "Count the letters of the alphabet, slowly."}]


def _backend(path: Path, **config: Any) -> SGLangBackend:
    settings = SGLangConfig(weight_sync_method="merged", merged_bucket_bytes=64 << 10, **config)
    return SGLangBackend(path=str(path), sglang_config=settings)


def _ask(model: art.TrainableModel, **extra: Any) -> Any:
    """A long rollout (EOS ignored) with logprobs on the model's current step."""
    return model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=LONG, logprobs=True, **extra
    )


async def _long_rollout(model: art.TrainableModel) -> Any:
    return (await _ask(model, extra_body={"ignore_eos": True})).choices[0]


async def _long_streamed_rollout(model: art.TrainableModel) -> Any:
    """The streamed rollout's chunks put together as a Choice (with the fields of its last chunk's choice).
    Its text holds every sampled token (EOS among them), so its tokens spell it for the trainer."""
    stream = await _ask(model, stream=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    return await choice_of_stream(stream, VERSIONS_FIELD)


async def _across_a_step(
    backend: SGLangBackend, model: art.TrainableModel, groups: list, rollout_fn: Any = _long_rollout
) -> Any:
    """A long rollout on the current step, held mid-generation (an in-place pause) while train() makes
    the next step, whose push aborts it; returns its choice once the gateway continued it."""
    rollout = asyncio.create_task(rollout_fn(model))
    await asyncio.sleep(1.0)  # generating
    assert not rollout.done()
    assert backend.inference is not None
    [server] = backend.inference.servers.live()  # its admin client
    await server.pause_generation("in_place")  # holds it; the push's pause (abort) ends it
    await backend.train(model, groups, learning_rate=5e-2, allow_training_without_logprobs=True)
    return await asyncio.wait_for(rollout, 300)


def _assert_one_choice_of_two_versions(choice: Any, name: str, step: int) -> list[dict[str, Any]]:
    spans = getattr(choice, VERSIONS_FIELD)
    assert [span["version"] for span in spans] == [f"{name}@{step}", f"{name}@{step + 1}"]
    assert all(span["tokens"] > 0 for span in spans)
    assert sum(span["tokens"] for span in spans) == LONG
    if getattr(choice, "token_ids", None) is not None:  # whole answers carry the sampled ids
        assert len(choice.token_ids) == LONG
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.content) == LONG  # every token's logprob, from the weights that sampled it
    return spans


@contextlib.asynccontextmanager
async def _rolled_out_across_a_step(
    path: Path, base_model: Path, rollout_fn: Any, **config: Any
) -> AsyncIterator[tuple[SGLangBackend, art.TrainableModel, Any]]:
    """(backend, model, the choice of a long rollout of step 0 held across step 1's push), checked to be one
    complete choice of two version spans."""
    backend = _backend(path, **config)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(base_model))
    try:
        await model.register(backend)
        groups = await sample_groups(model, seed=1)
        choice = await _across_a_step(backend, model, groups, rollout_fn)
        _assert_one_choice_of_two_versions(choice, "fused", 0)
        assert model.get_inference_name() == "fused@1"
        yield backend, model, choice
    finally:
        await backend.close()


@pytest.mark.parametrize("rollout_fn", [_long_rollout, _long_streamed_rollout], ids=["whole", "streamed"])
async def test_a_rollout_across_an_update_is_one_choice_of_two_versions(
    tmp_path: Path, tiny_model_path: Path, rollout_fn: Any
) -> None:
    """Whole: trained on its sampled ids. Streamed: from its text and per-token logprobs (no ids)."""
    async with _rolled_out_across_a_step(
        tmp_path / ".art", tiny_model_path, rollout_fn, max_steps_off_policy=1
    ) as (backend, model, choice):
        # The trainer takes it one step behind (max_steps_off_policy=1)...
        rollout = art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=1.0)
        short = (await sample_groups(model, groups=1, size=1, seed=2))[0].trajectories[0]
        stitched = [art.TrajectoryGroup([rollout, short])]
        result = await backend.train(model, stitched, learning_rate=5e-2)
        assert result.step == 2
        # ...and refuses it two steps behind, naming the weights and the bound.
        with pytest.raises(
            TrainingInputError, match=r"`fused@0`, 2 steps behind step 2.*max_steps_off_policy=1"
        ):
            await backend.train(model, stitched, learning_rate=5e-2)
        # The step the bound still serves answers (with the newest weights, and says so); an older one is 404.
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            url = f"{model.inference_base_url}/chat/completions"
            older = await http.post(url, json={"model": "fused@1", "messages": PROMPT, "max_tokens": 2})
            oldest = await http.post(url, json={"model": "fused@0", "messages": PROMPT, "max_tokens": 2})
        assert older.status_code == 200, older.text
        assert older.json()["choices"][0][VERSIONS_FIELD] == [{"version": "fused@2", "tokens": 2}]
        assert oldest.status_code == 404 and "hold `fused@2`" in oldest.json()["error"]["message"]


async def test_without_the_bound_a_rollout_across_an_update_is_refused(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    # max_steps_off_policy unset: 0 steps
    async with _rolled_out_across_a_step(tmp_path / ".art", tiny_model_path, _long_rollout) as (
        backend,
        model,
        choice,
    ):
        rollout = art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=1.0)
        with pytest.raises(TrainingInputError, match=r"group 0, trajectory 0: .*`fused@0`, 1 steps behind"):
            await backend.train(model, [art.TrajectoryGroup([rollout, rollout])], learning_rate=5e-2)


async def _cached_tokens(model: art.TrainableModel) -> int:
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=PROMPT,
        max_tokens=1,  # type: ignore[arg-type]
    )
    details = completion.usage.prompt_tokens_details if completion.usage is not None else None
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.mark.parametrize("flush", [None, False])
async def test_each_update_flushes_the_prefix_cache_unless_allowed(
    tmp_path: Path, tiny_model_path: Path, flush: bool | None
) -> None:
    backend = _backend(tmp_path / ".art", flush_cache_on_sync=flush)
    model = art.TrainableModel(name="fused", project="merged", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        groups = await sample_groups(model, seed=1)
        await _cached_tokens(model)
        cached = await _cached_tokens(model)
        assert cached > 0  # the prompt is cached
        await backend.train(model, groups, learning_rate=5e-2, allow_training_without_logprobs=True)
        # Flushed: only what requests since the update computed is cached (the chat template's opening,
        # shared with the publish probe); kept: the whole prompt, computed by the older policy.
        after = await _cached_tokens(model)
        assert after == cached if flush is False else after < cached
    finally:
        await backend.close()
