"""A weight pusher in a process of its own, as the trainer is: `python pusher.py BASE_URL` reads one JSON
command per line on stdin and pushes tensors with `/update_weights_from_tensor`, answering one JSON line
per command (each call's status and body). A process of its own because a CPU tensor is shared through
torch's shared-memory manager, a helper process that lives as long as the process that shares.

Command: {"model": checkpoint directory (with "adapter": that adapter's merged weights, as the trainer
computes them) | "ones": [[name, shape], ...], "max_bytes": bucket bound,
"first_only": push only the first bucket, "load_format": null | "flattened_bucket", "version": the weight
version sent with the last bucket, "flush": whether the last bucket flushes the cache}.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import torch
from weight_push import state_tensors

from art_sglang import named_tensors
from art_sglang.named_tensors import NamedTensors
from art_sglang.training.merged_weights import merged_weights


def tensors(command: dict[str, Any]) -> NamedTensors:
    if "ones" in command:
        return [(name, torch.ones(shape)) for name, shape in command["ones"]]
    if "adapter" in command:  # the trainer's merged weights of the model with that adapter
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(command["model"], dtype=torch.float32)
        return list(merged_weights(PeftModel.from_pretrained(base, command["adapter"])))
    return state_tensors(command["model"])


def push(client: httpx.Client, command: dict[str, Any]) -> list[dict[str, Any]]:
    parts = list(named_tensors.buckets(tensors(command), command.get("max_bytes", 1 << 40)))
    if command.get("first_only"):
        parts = parts[:1]
    answers = []
    for i, bucket in enumerate(parts):
        last = i == len(parts) - 1
        body = {
            "serialized_named_tensors": [named_tensors.serialize(bucket, command.get("load_format"))],
            "load_format": command.get("load_format"),
            "flush_cache": last and command.get("flush", True),
        }
        if last and command.get("version") is not None:
            body["weight_version"] = command["version"]
        try:
            response = client.post("/update_weights_from_tensor", json=body)
        except httpx.HTTPError as exc:
            answers.append({"status": None, "error": repr(exc)})
            break
        answers.append({"status": response.status_code, "body": response.text})
        if response.status_code != 200:
            break
    return answers


def main() -> None:
    with httpx.Client(base_url=sys.argv[1], timeout=120.0, trust_env=False) as client:
        for line in sys.stdin:
            print(json.dumps(push(client, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
