"""Weights in SGLang's serialized forms (art_sglang/named_tensors.py): what goes in comes out, in both
formats and across processes, buckets keep their bound, and a payload that names anything but tensors is
refused before it runs."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from art_sglang import named_tensors
from art_sglang.named_tensors import PayloadError

# The sender runs in a process of its own, as the trainer does: sharing a CPU tensor starts torch's
# shared-memory manager, a helper process that lives as long as the sharing process.
SENDER = """
import sys, torch
from art_sglang import named_tensors
torch.manual_seed(0)
named = [("model.layers.0.mlp.up_proj.weight", torch.randn(8, 4)), ("model.norm.weight", torch.randn(4).bfloat16())]
print(named_tensors.serialize(named, None if sys.argv[1] == "list" else sys.argv[1]), flush=True)
sys.stdin.readline()  # the tensors are shared, not copied: alive until the reader is done
"""


def _expected() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.layers.0.mlp.up_proj.weight", torch.randn(8, 4)),
        ("model.norm.weight", torch.randn(4).bfloat16()),
    ]


@pytest.mark.parametrize("load_format", ["list", "flattened_bucket"])
def test_another_process_reads_the_tensors_by_name(load_format: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, load_format], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert sender.stdin is not None and sender.stdout is not None
    try:
        payload = sender.stdout.readline().strip()
        back = named_tensors.deserialize(payload, None if load_format == "list" else load_format)  # type: ignore[arg-type]
        expected = _expected()
        assert [name for name, _ in back] == [name for name, _ in expected]
        for (_, ours), (_, theirs) in zip(back, expected, strict=True):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    finally:
        sender.stdin.write("done\n")
        sender.stdin.close()
        assert sender.wait(60) == 0


def test_buckets_keep_their_bound_and_order() -> None:
    named = [(f"w{i}", torch.zeros(10)) for i in range(7)]  # 40 bytes each
    parts = list(named_tensors.buckets(named, 100))
    assert [len(p) for p in parts] == [2, 2, 2, 1]
    assert [n for part in parts for n, _ in part] == [n for n, _ in named]
    assert [len(p) for p in named_tensors.buckets([("big", torch.zeros(100))], 100)] == [1]  # alone


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "payload",
    [
        base64.b64encode(pickle.dumps([("w", _Exploit())])).decode(),
        base64.b64encode(pickle.dumps([("w", 3)])).decode(),
        "not base64!",
        base64.b64encode(b"not a pickle").decode(),
    ],
    ids=["names-os.system", "no-tensor", "not-base64", "not-a-pickle"],
)
def test_anything_but_named_tensors_is_refused(payload: str) -> None:
    with pytest.raises(PayloadError):
        named_tensors.deserialize(payload)
