"""Helpers for the trainer tests: Choices built like a server returns them (text, per-token logprobs
with bytes, finish_reason), scored by a real model so the sampler logprobs are the model's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from openai.types.chat.chat_completion import Choice

from art_sglang.trajectories import Trajectory, TrajectoryGroup


def make_choice(
    tokenizer: Any, text: str, logprobs: list[float] | None = None, finish_reason: str = "stop"
) -> Choice:
    """A Choice whose logprob entries are the tokenizer's tokens of `text` (-1.0 each unless given)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    values = logprobs if logprobs is not None else [-1.0] * len(ids)
    entries = [
        {
            "token": tokenizer.decode([i]),
            "bytes": list(tokenizer.decode([i]).encode()),
            "logprob": lp,
            "top_logprobs": [],
        }
        for i, lp in zip(ids, values, strict=False)
    ]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": entries},
        }
    )


def trajectory(prompt: str, choice: Choice, reward: float) -> Trajectory:
    return Trajectory(messages_and_choices=[{"role": "user", "content": prompt}, choice], reward=reward)


class Scorer:
    """Per-token logprobs of an assistant answer under the base model plus an optional adapter."""

    def __init__(self, model_path: Path, adapter: Path | None = None) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = PeftModel.from_pretrained(model, str(adapter)) if adapter is not None else model
        self.model.eval()

    def use_adapter(self, adapter: Path) -> None:
        """Swap in another checkpoint's adapter weights (much faster than loading a new PeftModel)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(self.model, load_file(str(adapter / "adapter_model.safetensors")))
        assert not result.unexpected_keys

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    @torch.no_grad()
    def token_logprobs(self, prompt: str, text: str) -> list[float]:
        """Logprobs of the answer's tokens followed by the end-of-turn token."""
        head = self.prompt_ids(prompt)
        answer = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        ids = torch.tensor([head + answer])
        logp = self.model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        targets = ids[0, 1:]
        picked = logp.gather(1, targets[:, None]).squeeze(1)
        return picked[len(head) - 1 :].tolist()

    def scored_choice(self, prompt: str, text: str) -> Choice:
        """A Choice carrying this model's logprobs, the trailing entry being the stop token (as SGLang)."""
        values = self.token_logprobs(prompt, text)
        choice = make_choice(self.tokenizer, text, values[:-1])
        assert choice.logprobs is not None and choice.logprobs.content is not None
        eot = self.tokenizer.eos_token
        choice.logprobs.content.append(
            type(choice.logprobs.content[0])(
                token=eot, bytes=list(eot.encode()), logprob=values[-1], top_logprobs=[]
            )
        )
        return choice

    @torch.no_grad()
    def greedy(self, prompt: str, max_new_tokens: int = 12) -> list[int]:
        ids = torch.tensor([self.prompt_ids(prompt)])
        out = self.model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.shape[1] :].tolist()


def group(trajectories: list[Trajectory]) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories)


def sampled(
    tokenizer: Any, ids: list[int], logprobs: list[float], finish_reason: str = "stop", **fields: Any
) -> Choice:
    """A Choice as SGLang returns it with return_token_ids: text, one logprob entry per id, the ids
    (`fields`: more of the Choice's fields, e.g. the constraint the gateway attaches)."""
    entries = [
        {"token": (t := tokenizer.decode([i])), "bytes": list(t.encode()), "logprob": lp, "top_logprobs": []}
        for i, lp in zip(ids, logprobs, strict=False)
    ]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)},
            "logprobs": {"content": entries},
            "token_ids": ids,
            "prompt_token_ids": [1],
            **fields,
        }
    )
