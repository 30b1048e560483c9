"""What the ART-program tests share: a tool, a conversation that calls it, a chat template with a
template variable, and ART-layout checkpoint folders written the way Unsloth/peft write them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))  # the backend tests' helpers

from backend_helpers import tree_snapshot

from art_sglang.config import DEFAULT_LORA_TARGETS
from art_sglang.tiny_model import CHAT_TEMPLATE

__all__ = ["tree_snapshot"]

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ],
}
# The tiny model's ChatML template with a variable only chat_template_kwargs can set.
STYLED_TEMPLATE = (
    "{% if style %}<|im_start|>system\nstyle: {{ style }}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
)


def sft_file(path: Path, copies: int) -> Path:
    """A JSONL file in ART's SFT format: `copies` lines of the question answered by the tool call."""
    line = json.dumps({"messages": [*QUESTION, CALL], "tools": [ADD_TOOL]})
    path.write_text((line + "\n") * copies)
    return path


async def teach_tool_call(model: Any, folder: Path) -> None:
    """SFT with ART's `train_sft_from_file` until the model answers QUESTION with CALL (60 single-line
    batches at a constant 5e-3: the loss reaches ~0 by batch 40 on the sharpened tiny models)."""
    from art.utils.sft import train_sft_from_file

    await train_sft_from_file(
        model,
        str(sft_file(folder / "calls.jsonl", 60)),
        batch_size=1,
        peak_lr=5e-3,
        schedule_type="constant",
        warmup_ratio=0.0,
    )


def tool_call_of(message: Any) -> tuple[str, dict[str, Any]]:
    [call] = message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


def write_art_checkpoints(model_dir: Path, base_model: Path, steps: list[int]) -> None:
    """`checkpoints/<step:04d>/` with adapter files only, as ART's LocalBackend leaves them (r=8,
    alpha=16, ART's defaults), each with different random LoRA B weights; plus ART's model.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, target_modules=list(DEFAULT_LORA_TARGETS), task_type="CAUSAL_LM"),
    )
    for step in steps:
        torch.manual_seed(step)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.data = torch.randn_like(param) * 0.01
        peft_model.save_pretrained(model_dir / "checkpoints" / f"{step:04d}")
    (model_dir / "model.json").write_text(json.dumps({"name": model_dir.name, "trainable": True}))


async def ask(model: Any, messages: list[Any], **options: Any) -> Any:
    """One chat completion on the model's current step with the add tool offered (the model's own client)."""
    return await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, tools=[ADD_TOOL], **options
    )


async def tool_episode(ART: Any, model: Any, seed: int, max_tokens: int = 40) -> Any:
    """One tool-using episode as an ART Trajectory: the model's call, the tool's answer, the model's
    reply (the reward varies with the seed so that groups carry a signal)."""
    first = (await ask(model, QUESTION, max_tokens=max_tokens, logprobs=True, seed=seed)).choices[0]
    history: list[Any] = [*QUESTION, first]
    if first.message.tool_calls:
        tool = {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "5"}
        wire = [*QUESTION, first.message.model_dump(exclude_none=True), tool]
        second = (await ask(model, wire, max_tokens=8, logprobs=True, seed=seed)).choices[0]
        history += [tool, second]
    return ART.Trajectory(messages_and_choices=history, tools=[ADD_TOOL], reward=float(seed % 3))


async def streamed_call(stream: Any) -> tuple[str, dict[str, Any], str | None]:
    """(function name, arguments, finish reason) assembled from a streamed tool call."""
    name, arguments, finish = "", "", None
    async for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            name += (call.function.name or "") if call.function else ""
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return name, json.loads(arguments), finish
