"""An OpenPipe ART program — ART's own TrainableModel (with `_internal_config`), Trajectory,
TrajectoryGroup, gather_trajectory_groups, `model.openai_client()`, `model.train_sft` and
`art.utils.sft.train_sft_from_file` — runs on SGLangBackend with only the backend swapped; and a run
directory ART wrote resumes at its step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from art_helpers import (
    ADD_TOOL,
    CALL,
    QUESTION,
    STYLED_TEMPLATE,
    ask,
    streamed_call,
    teach_tool_call,
    tool_call_of,
    tool_episode,
    tree_snapshot,
    write_art_checkpoints,
)

from art_sglang import SGLangBackend


async def test_art_program_with_internal_config_sft_and_tool_calls(
    ART, tmp_path: Path, tool_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / ".art"
    model = ART.TrainableModel(
        name="art-agent",
        project="art-compat",
        base_model=str(tool_model_path),
        _internal_config=ART.dev.InternalModelConfig(
            peft_args={"r": 16, "lora_alpha": 32},
            init_args={"max_seq_length": 1024},
            trainer_args={"weight_decay": 0.01, "max_grad_norm": 1.0, "adam_beta2": 0.99},
            engine_args={"max_model_len": 2048},
            chat_template=STYLED_TEMPLATE,
            chat_template_kwargs={"style": "terse"},
        ),
    )
    checkpoints = path / "art-compat" / "models" / "art-agent" / "checkpoints"
    async with SGLangBackend(path=str(path)) as backend:
        await model.register(backend)
        assert model.get_inference_name() == "art-agent@0"
        client = model.openai_client()

        # The server renders prompts with the model's template and chat_template_kwargs (ART's client sends them).
        reply = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=QUESTION,
            max_tokens=2,
            extra_body={"return_token_ids": True},
        )
        tokenizer = AutoTokenizer.from_pretrained(tool_model_path)
        expected = tokenizer.apply_chat_template(
            QUESTION,
            chat_template=STYLED_TEMPLATE,
            style="terse",
            add_generation_prompt=True,
            return_dict=False,
        )
        assert reply.choices[0].model_extra["prompt_token_ids"] == list(expected)

        # SFT from a file teaches the tool call; one call is one step.
        await teach_tool_call(model, tmp_path)
        assert await model.get_step() == 1 and model.get_inference_name() == "art-agent@1"
        # The adapter has _internal_config's shape; the trainer ran with its settings.
        assert json.loads((checkpoints / "0001" / "adapter_config.json").read_text())["r"] == 16
        assert json.loads((checkpoints / "0001" / "adapter_config.json").read_text())["lora_alpha"] == 32
        config = json.loads((checkpoints / "0001" / "trainer_state.json").read_text())["config"]
        assert (
            config["max_seq_length"] == 1024
            and config["weight_decay"] == 0.01
            and config["adam_beta2"] == 0.99
        )
        assert config["chat_template"] == STYLED_TEMPLATE and config["chat_template_kwargs"] == {
            "style": "terse"
        }

        # Tool calls come back parsed, whole and streamed.
        called = (await ask(model, QUESTION, temperature=0, max_tokens=40)).choices[0]
        assert called.finish_reason == "tool_calls"
        assert tool_call_of(called.message) == ("add", {"a": 2, "b": 3})
        stream = await ask(model, QUESTION, temperature=0, max_tokens=40, stream=True)
        assert await streamed_call(stream) == ("add", {"a": 2, "b": 3}, "tool_calls")

        # model.train_sft with ART's config: another step, its metrics in ART's history.
        await model.train_sft(
            [ART.Trajectory(messages_and_choices=[*QUESTION, CALL], tools=[ADD_TOOL])] * 2,
            config=ART.TrainSFTConfig(learning_rate=1e-3, batch_size=1),
        )
        assert await model.get_step() == 2
        rows = [json.loads(line) for line in (checkpoints.parent / "history.jsonl").read_text().splitlines()]
        assert {row["step"] for row in rows if any("loss/train" in key for key in row)} == {1, 2}

        # RL on tool-using episodes (tool_calls and tool messages), ART's groups; save_checkpoint=False as ART.
        groups = await ART.gather_trajectory_groups(
            (
                ART.TrajectoryGroup(tool_episode(ART, model, seed=10 * g + i) for i in range(3))
                for g in range(2)
            ),
            pbar_desc=None,
        )
        assert any(t.messages_and_choices[1].message.tool_calls for g in groups for t in g.trajectories)
        # A trajectory without any Choice (all plain messages) is context, trained around as in ART.
        groups[0].trajectories.append(ART.Trajectory(messages_and_choices=[*QUESTION, CALL], reward=0.5))
        result = await backend.train(model, groups, learning_rate=1e-3, save_checkpoint=False)
        assert result.step == 3 and result.checkpoint_path is None
        assert result.metrics["tokenize/choices"] > 6  # every turn of every episode
        result = await backend.train(model, groups, learning_rate=1e-3)
        assert result.checkpoint_path == str(checkpoints / "0004")
        await model.log(groups, split="train")  # ART's own logging (parquet) works with the `art` extra
        assert model.get_inference_name() == "art-agent@4"


async def test_run_directory_written_by_art_resumes_at_its_step(
    ART, tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / ".art"
    model_dir = path / "proj" / "models" / "agent"
    write_art_checkpoints(model_dir, tiny_model_path, [0, 1, 2, 3, 4])
    # The newest checkpoint was cut short (a crash while copying it): resume falls back to step 3.
    truncated = model_dir / "checkpoints" / "0004" / "adapter_model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    theirs = tree_snapshot(model_dir / "checkpoints")
    caplog.set_level(logging.WARNING)

    model = ART.TrainableModel(name="agent", project="proj", base_model=str(tiny_model_path))
    async with SGLangBackend(path=str(path)) as backend:
        await model.register(backend)
        assert await model.get_step() == 3 and model.get_inference_name() == "agent@3"
        assert "0004/adapter_model.safetensors" in caplog.text and "set aside" in caplog.text
        assert "the optimizer starts fresh" in caplog.text
        [aside] = [p for p in (model_dir / "checkpoints").iterdir() if p.name.startswith("0004.broken-")]
        assert (aside / "adapter_model.safetensors").stat().st_size == 100
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.model == "agent@3"

        groups = await ART.gather_trajectory_groups(
            (ART.TrajectoryGroup(tool_episode(ART, model, seed=s) for s in range(3)),), pbar_desc=None
        )
        result = await backend.train(model, groups, learning_rate=1e-3)
        assert result.step == 4 and result.checkpoint_path == str(model_dir / "checkpoints" / "0004")
    # Our step 4 is complete once the trainer has stopped: its optimizer state follows the answer (written in
    # the background after the step's own fsyncs) and is on disk before the worker exits.
    assert (model_dir / "checkpoints" / "0004" / "optimizer.pt").is_file()
    # Nothing ART wrote was changed: steps 0-3 as they were, the broken step 4 kept under its new name.
    after = tree_snapshot(model_dir / "checkpoints")
    for name, size in theirs.items():
        step, file = name.split("/", 1)
        kept = name if step != "0004" else f"{aside.name}/{file}"
        assert after[kept] == size
