"""Merged-weight sync cost (issue 40, docs/merged-rollouts.md): the time from a trained adapter in the
trainer's memory to a server answering with the merged weights, by transport and bucket size.

This process plays the trainer: the model with a random adapter (`--lora-rank`, every linear layer) on
`--device`, merged out of place by the trainer's code (`art_sglang.training.merged_weights`). Each push:
`/pause_generation` (abort), the LoRA-wrapped modules' merged weights in flattened buckets of at most
`--bucket-mb` (two alive at a time: the next is computed before the last one is known), the cache flush and
the weight version with the last bucket, `/continue_generation`; then one greedy token proves the server
answers with the new version. Transports:

- `tensor`: `/update_weights_from_tensor`, the buckets as CUDA IPC handles (CPU: shared-memory names), so
  `--device` must be the server's GPU (shared mode);
- `distributed`: `/init_weights_update_group` once, then `/update_weights_from_distributed` per bucket while
  this process broadcasts it (NCCL; gloo on CPU), so `--device` must be another GPU (split mode).

Per (transport, bucket size): the median of `--repeats` pushes, split into the merge alone (the buckets
computed, nothing sent) and the whole sync (pause to first token).

    python scripts/bench_weight_push.py --model /root/models/qwen2.5-1.5b-shape --transport tensor \\
        --device cuda:0 --bucket-mb 128 512 2048 --json out.json
    python scripts/bench_weight_push.py --model ... --transport distributed --device cuda:1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    environment,
    make_random_adapter,
    markdown_table,
    server_config,
    write_results,
)

from art_sglang import named_tensors, weight_group
from art_sglang.serving.servers.process import ServerProcess

GROUP = "bench_weight_push"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    parser.add_argument("--transport", choices=("tensor", "distributed"), default="tensor")
    parser.add_argument(
        "--device", default="cuda:0", help="where the trainer's model is (cpu with --engine reference)"
    )
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[512.0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = trainer_model(args)
    server = ServerProcess(
        server_config(args), args.model, engine=args.engine, log_path=args.workdir / "push-server.log"
    )
    asyncio.run(server.start())
    try:
        with httpx.Client(base_url=server.base_url, timeout=600.0, trust_env=False) as client:
            rows = measure(args, model, client)
    finally:
        asyncio.run(server.stop())
    results = {"environment": environment(), "transport": args.transport, "model": args.model, "rows": rows}
    headers = ["transport", "bucket MiB", "buckets", "merged MiB", "merge s", "sync s"]
    table = markdown_table(
        headers,
        [
            [r["transport"], r["bucket_mb"], r["buckets"], r["merged_mib"], r["merge_s"], r["sync_s"]]
            for r in rows
        ],
    )
    write_results(args, results, table)


def trainer_model(args: argparse.Namespace) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.device != "cpu":
        torch.cuda.set_device(args.device)  # NCCL's communicator is made on the current device
    adapter = make_random_adapter(
        args.model, args.workdir / f"push-adapter-r{args.lora_rank}", rank=args.lora_rank
    )
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def measure(args: argparse.Namespace, model: Any, client: httpx.Client) -> list[dict[str, Any]]:
    from art_sglang.training.merged_weights import merged_weights

    group = join_group(args, client) if args.transport == "distributed" else None
    rows = []
    try:
        for bucket_mb in args.bucket_mb:
            max_bytes = int(bucket_mb * 2**20)
            merges, syncs, buckets, merged_bytes = [], [], 0, 0
            for repeat in range(args.repeats):
                started = time.perf_counter()
                buckets, merged_bytes = 0, 0
                for part in named_tensors.buckets(merged_weights(model), max_bytes):  # one alive at a time
                    buckets += 1
                    merged_bytes += sum(t.numel() * t.element_size() for _, t in part)
                synchronize(args.device)
                merges.append(time.perf_counter() - started)
                started = time.perf_counter()
                sync(client, model, group, max_bytes, version=f"bench@{bucket_mb}-{repeat}")
                syncs.append(time.perf_counter() - started)
            rows.append(
                {
                    "transport": args.transport,
                    "bucket_mb": bucket_mb,
                    "buckets": buckets,
                    "merged_mib": merged_bytes / 2**20,
                    "merge_s": statistics.median(merges),
                    "sync_s": statistics.median(syncs),
                    "merge_s_all": merges,
                    "sync_s_all": syncs,
                }
            )
    finally:
        if group is not None:
            weight_group.leave(group)
    return rows


def sync(client: httpx.Client, model: Any, group: Any, max_bytes: int, version: str) -> None:
    """One publish: pause (abort), the buckets, continue, the first token of the new version."""
    from art_sglang.training.merged_weights import merged_weights

    check(client.post("/pause_generation", json={"mode": "abort"}))
    parts = named_tensors.buckets(merged_weights(model), max_bytes)
    bucket = next(parts)
    # The next bucket is computed before this one is sent, to know which is the last: two are alive.
    for following in itertools.chain(parts, [None]):
        last = following is None
        if group is None:
            push_tensor(client, bucket, last, version)
        else:
            broadcast(client, group, bucket, last, version)
        bucket = following
    check(client.post("/continue_generation", json={}))
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    answer = check(client.post("/generate", json=body))
    assert answer["meta_info"]["weight_version"] == version, answer["meta_info"]


def push_tensor(client: httpx.Client, bucket: named_tensors.NamedTensors, last: bool, version: str) -> None:
    body: dict[str, Any] = {
        "serialized_named_tensors": [named_tensors.serialize(bucket, "flattened_bucket")],
        "load_format": "flattened_bucket",
        "flush_cache": last,
    }
    if last:
        body["weight_version"] = version
    check(client.post("/update_weights_from_tensor", json=body))


def broadcast(
    client: httpx.Client, group: Any, bucket: named_tensors.NamedTensors, last: bool, version: str
) -> None:
    body: dict[str, Any] = {
        **named_tensors.describe(bucket),
        "group_name": GROUP,
        "load_format": "flattened_bucket",
        "flush_cache": last,
    }
    if last:
        body["weight_version"] = version
    answers: list[httpx.Response] = []
    posting = threading.Thread(
        target=lambda: answers.append(client.post("/update_weights_from_distributed", json=body))
    )
    posting.start()
    weight_group.broadcast(group, named_tensors.flatten(bucket)["flattened_tensor"])
    posting.join()
    check(answers[0])


def join_group(args: argparse.Namespace, client: httpx.Client) -> Any:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "gloo" if args.device == "cpu" else "nccl"
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": backend}  # fmt: skip
    answers: list[httpx.Response] = []
    joining = threading.Thread(
        target=lambda: answers.append(client.post("/init_weights_update_group", json=body))
    )
    joining.start()
    group = weight_group.join("127.0.0.1", port, 0, 2, GROUP, backend=backend)
    joining.join()
    check(answers[0])
    return group


def check(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise SystemExit(f"{response.request.url.path}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
