"""Helpers of the weight-update contract tests: a model's tensors by checkpoint name, pushing them as
`/update_weights_from_tensor` takes them, broadcasting them in a weight-update group, and the greedy
/generate answer the outputs are compared by. Engine-agnostic."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from art_sglang import named_tensors, weight_group
from art_sglang.named_tensors import LoadFormat, NamedTensors

PROMPT_IDS = [300, 400, 500]  # the tiny model answers it with visible text, so a stream shows progress


@dataclass(frozen=True)
class Greedy:
    """A greedy /generate answer: what the served weights decide."""

    output_ids: list[int]
    logprobs: list[float]
    weight_version: str


def assert_same(ours: Greedy, expected: Greedy, *, version: str | None = None) -> None:
    """The same tokens with the same logprobs (within float noise), under `version` if given (else the
    expected one's)."""
    assert ours.output_ids == expected.output_ids
    assert ours.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert ours.weight_version == (version or expected.weight_version)


def state_tensors(model_path: str) -> NamedTensors:
    """Every tensor of the checkpoint at `model_path`, by checkpoint name."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        weights.update(load_file(path))
    return list(weights.items())


def greedy(client: httpx.Client, input_ids: list[int] | None = None, max_new_tokens: int = 12) -> Greedy:
    body = {
        "input_ids": input_ids or PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    return Greedy(
        response.json()["output_ids"],
        [entry[0] for entry in meta["output_token_logprobs"]],
        meta["weight_version"],
    )


def from_disk(client: httpx.Client, path: str, version: str) -> None:
    """The weights at `path` loaded with /update_weights_from_disk: what pushed weights are compared to."""
    response = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version})
    assert response.status_code == 200, response.text


class Pusher:
    """`pusher.py` for the server at `base_url`: each `push` is one command, answered with the status and
    body of each `/update_weights_from_tensor` call it made."""

    def __init__(self, base_url: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("pusher.py")), base_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    def push(self, **command: Any) -> list[dict[str, Any]]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        assert answer, "the pusher exited"
        return json.loads(answer)

    def push_ok(self, **command: Any) -> int:
        """Push and assert every call succeeded; returns how many calls (buckets) it took."""
        answers = self.push(**command)
        for answer in answers:
            assert answer["status"] == 200, answer
            assert json.loads(answer["body"])["success"] is True
        return len(answers)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def update_group(client: httpx.Client, group_name: str) -> Iterator[Any]:
    """This process as rank 0 of a gloo weight-update group with the server as rank 1; left (on both
    sides) at the end."""
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group_name,
        "backend": "gloo",
    }
    answers: list[httpx.Response] = []
    joining = threading.Thread(
        target=lambda: answers.append(client.post("/init_weights_update_group", json=body))
    )
    joining.start()
    group = weight_group.join("127.0.0.1", port, 0, 2, group_name, backend="gloo", timeout_s=60)
    joining.join(60)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    try:
        yield group
    finally:
        weight_group.leave(group)
        left = client.post("/destroy_weights_update_group", json={"group_name": group_name})
        assert left.status_code == 200, left.text


def broadcast_all(
    client: httpx.Client,
    group: Any,
    group_name: str,
    named: NamedTensors,
    *,
    load_format: LoadFormat,
    weight_version: str,
) -> httpx.Response:
    """One `/update_weights_from_distributed` call and its broadcast from rank 0, side by side."""
    body = {
        "names": [name for name, _ in named],
        "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
        "group_name": group_name,
        "load_format": load_format,
        "weight_version": weight_version,
    }
    answers: list[httpx.Response] = []
    posting = threading.Thread(
        target=lambda: answers.append(client.post("/update_weights_from_distributed", json=body))
    )
    posting.start()
    if load_format is None:
        for _, tensor in named:
            weight_group.broadcast(group, tensor)
    else:
        weight_group.broadcast(group, named_tensors.flatten(named)["flattened_tensor"])
    posting.join(120)
    assert answers, "no answer to /update_weights_from_distributed"
    return answers[0]


class Asked:
    """A greedy /generate sent from a thread of its own (and a client of its own) at creation."""

    def __init__(self, base_url: str) -> None:
        self.answers: list[Greedy] = []
        self._thread = threading.Thread(target=self._ask, args=(base_url,), daemon=True)
        self._thread.start()

    def _ask(self, base_url: str) -> None:
        with httpx.Client(base_url=base_url, timeout=120.0, trust_env=False) as client:
            self.answers.append(greedy(client))

    def answer(self, timeout: float = 120.0) -> Greedy:
        self._thread.join(timeout)
        assert self.answers, "the request was not answered"
        return self.answers[0]


class Streamed:
    """A streaming greedy /generate of `max_new_tokens` tokens (EOS ignored), read in a thread: its events
    as they arrive (each carries the whole output so far)."""

    def __init__(self, base_url: str, max_new_tokens: int) -> None:
        self.events: list[dict[str, Any]] = []
        body = {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "return_logprob": True,
            "stream": True,
        }
        self._thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self._thread.start()

    def _read(self, base_url: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=base_url, timeout=120.0, trust_env=False) as client:
            try:
                with client.stream("POST", "/generate", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            self.events.append(json.loads(line[len("data: ") :]))
            except httpx.HTTPError:
                pass  # the server went away mid-stream

    @property
    def output_ids(self) -> list[int]:
        return list(self.events[-1]["output_ids"]) if self.events else []

    def wait_for(self, tokens: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.output_ids) < tokens:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the stream did not get going"
            time.sleep(0.01)

    def still(self, seconds: float) -> list[int]:
        """The output once nothing arrived for `seconds` (what was sent before a pause, read)."""
        before = self.output_ids
        while True:
            time.sleep(seconds)
            now = self.output_ids
            if now == before:
                return now
            before = now

    def final(self, timeout: float = 120.0) -> dict[str, Any]:
        self._thread.join(timeout)
        assert not self._thread.is_alive() and self.events
        return self.events[-1]


@contextmanager
def paused(client: httpx.Client, mode: str) -> Iterator[None]:
    """Generation paused in `mode` for the block, continued however it ends."""
    response = client.post("/pause_generation", json={"mode": mode})
    assert response.status_code == 200, response.text
    assert response.json() == {"message": "Generation paused successfully.", "status": "ok"}
    try:
        yield
    finally:
        response = client.post("/continue_generation", json={})
        assert response.status_code == 200, response.text
        assert response.json() == {"message": "Generation continued successfully.", "status": "ok"}
