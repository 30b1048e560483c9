"""One OpenPipe ART program on real SGLang in shared mode (one GPU): ART's own TrainableModel with
`_internal_config` (LoRA rank, engine memory, chat template kwargs), SFT that teaches a tool call, tool
calls parsed by SGLang's `hermes` parser (whole and streamed), then 2 RL steps on tool-using episodes.

    pytest -m gpu tests/gpu/test_art_program.py        (~4 min on an H100)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gpu_helpers import record, sglang_test_config

from art_sglang import SGLangBackend
from art_sglang.chat_format import template_tools

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "art"))
from art_helpers import ADD_TOOL, QUESTION, ask, streamed_call, teach_tool_call, tool_call_of, tool_episode

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tool_model(gpu_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The GPU tiny model with its output layer scaled up, so SFT can make a tool call certain (a random
    output layer of std 0.02 keeps logits within about ±1; LoRA does not train it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tool-model")
    model = AutoModelForCausalLM.from_pretrained(gpu_model)
    model.lm_head.weight.data *= 25
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gpu_model).save_pretrained(out)
    return str(out)


async def test_art_program_with_tools_and_internal_config_on_sglang(
    openpipe_art, tool_model: str, tmp_path: Path
) -> None:
    ART = openpipe_art
    from transformers import AutoTokenizer

    model = ART.TrainableModel(
        name="art-gpu",
        project="art-compat",
        base_model=tool_model,
        _internal_config=ART.dev.InternalModelConfig(
            peft_args={"r": 16, "lora_alpha": 32},
            engine_args={"gpu_memory_utilization": 0.3},
            chat_template_kwargs={"style": "terse"},
        ),
    )
    backend = SGLangBackend(
        path=str(tmp_path / ".art"),
        inference_device=0,
        training_devices=[0],
        sglang_config=sglang_test_config(),
    )
    assert backend.layout.mode == "shared" and backend.sglang_config.tool_call_parser == "hermes"
    try:
        await model.register(backend)
        checkpoints = tmp_path / ".art" / "art-compat" / "models" / "art-gpu" / "checkpoints"
        assert json.loads((checkpoints / "0000" / "adapter_config.json").read_text())["r"] == 16

        await teach_tool_call(model, tmp_path)
        assert await model.get_step() == 1
        # SGLang renders the prompt from its own dump of the tools (chat_format.py); the trainer renders the same.
        probe = await ask(
            model,
            QUESTION,
            max_tokens=1,
            extra_body={"return_token_ids": True, "return_prompt_token_ids": True},
        )
        served_prompt = probe.choices[0].model_extra.get("prompt_token_ids")
        trainer_prompt = AutoTokenizer.from_pretrained(tool_model).apply_chat_template(
            QUESTION,
            tools=template_tools([ADD_TOOL]),
            add_generation_prompt=True,
            return_dict=False,
            style="terse",
        )
        record("art_program_prompt_ids", served=served_prompt, trainer=list(trainer_prompt))
        assert served_prompt == list(trainer_prompt)
        whole = (await ask(model, QUESTION, temperature=0, max_tokens=48)).choices[0]
        record("art_program_tool_call", finish=whole.finish_reason, content=whole.message.content,
               tool_calls=[c.model_dump() for c in whole.message.tool_calls or []])  # fmt: skip
        assert whole.finish_reason == "tool_calls" and tool_call_of(whole.message) == (
            "add",
            {"a": 2, "b": 3},
        )
        stream = await ask(model, QUESTION, temperature=0, max_tokens=48, stream=True)
        assert await streamed_call(stream) == ("add", {"a": 2, "b": 3}, "tool_calls")

        for step in (2, 3):
            groups = await ART.gather_trajectory_groups(
                (
                    ART.TrajectoryGroup(tool_episode(ART, model, seed=10 * g + i) for i in range(4))
                    for g in range(2)
                ),
                pbar_desc=None,
            )
            result = await backend.train(model, groups, learning_rate=1e-4)
            record("art_program_rl_step", step=result.step, metrics=result.metrics)
            assert result.step == step and result.checkpoint_path == str(checkpoints / f"{step:04d}")
            # The gateway computed each group's prompt once (its prefill sharing is on by default), and
            # the trainer scores the sampled tokens as SGLang sampled them: with one gradient step the
            # mean importance ratio is 1 up to bf16 noise (0.998-0.999 in earlier runs).
            assert result.metrics["rollout/prefill_requests"] >= 1
            assert result.metrics["rollout/prefill_failures"] == 0
            assert result.metrics["gradient_steps"] == 1
            assert abs(result.metrics["ratio_mean"] - 1) < 0.01
            assert model.get_inference_name() == f"art-gpu@{step}"
        await model.log(groups, split="train")
        assert os.path.isdir(
            tmp_path / ".art" / "art-compat" / "models" / "art-gpu" / "trajectories" / "train"
        )
    finally:
        await backend.close()
