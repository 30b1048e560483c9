"""What the GPU tests and the device benchmarks share: GPU memory per process from nvidia-smi (a 200 from
`/release_memory_occupation` proves nothing, memory does), rollouts with a reward that varies inside a
group, SGLang's own logprobs, the trainer's recomputation of them, and a JSONL record of the numbers each
test measured."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from art_sglang import SGLangConfig, Trajectory, TrajectoryGroup

RESULTS_ENV = "ART_SGLANG_GPU_RESULTS"  # JSONL file the measured numbers are appended to


def record(test: str, **data: Any) -> None:
    """Append one result row (also printed, so `pytest -s` logs show it)."""
    row = {"test": test, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    print("RESULT", json.dumps(row, default=str))
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def sglang_test_config(**overrides: Any) -> SGLangConfig:
    """Launch settings for tests on the device kit: no CUDA graphs (a start costs ~76 s instead of ~180 s),
    SGLang's own attention (FlashAttention-3 on Hopper) and PyTorch sampling (FlashInfer's sampling kernels
    compile at first use, and the GPU machine has no CUDA compiler)."""
    settings: dict[str, Any] = {
        "disable_cuda_graph": True,
        "sampling_backend": "pytorch",
        "mem_fraction_static": 0.3,
        "enable_cache_report": True,
    }
    settings.update(overrides)
    return SGLangConfig(**settings)


# --- GPU memory, per process ------------------------------------------------------------------------------
def gpu_uuids() -> dict[str, int]:
    """nvidia-smi's GPU uuid -> index (physical numbering)."""
    out = _smi("--query-gpu=index,uuid")
    return {uuid: int(index) for index, uuid in (line.split(", ") for line in out)}


def gpu_used_mib() -> dict[int, int]:
    """Memory used on each GPU (physical index), all processes together."""
    return {int(i): int(m) for i, m in (line.split(", ") for line in _smi("--query-gpu=index,memory.used"))}


def compute_apps() -> list[tuple[int, int, int]]:
    """(pid, physical GPU index, used MiB) of every process holding GPU memory."""
    index = gpu_uuids()
    apps = []
    for line in _smi("--query-compute-apps=pid,gpu_uuid,used_memory"):
        pid, uuid, used = line.split(", ")
        apps.append((int(pid), index.get(uuid, -1), int(used) if used.isdigit() else 0))
    return apps


def _smi(query: str) -> list[str]:
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    )
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def role_of(proc: psutil.Process) -> str | None:
    """'server' for SGLang's processes, 'trainer' for the trainer worker, None otherwise."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "art_sglang.training" in cmd:  # checked first: the name contains "sglang" too
        return "trainer"
    if "sglang" in cmd:
        return "server"
    return None


def server_pids() -> set[int]:
    """Pids of this process's SGLang server processes."""
    return {p.pid for p in psutil.Process().children(recursive=True) if role_of(p) == "server"}


@dataclass
class Snapshot:
    """GPU memory (MiB) held by this process's server and trainer descendants, per physical GPU."""

    t: float
    server: dict[int, int] = field(default_factory=dict)
    trainer: dict[int, int] = field(default_factory=dict)
    server_alive: bool = False
    trainer_alive: bool = False
    total: dict[int, int] = field(default_factory=dict)

    def server_mib(self) -> int:
        return sum(self.server.values())

    def trainer_mib(self) -> int:
        return sum(self.trainer.values())


def snapshot() -> Snapshot:
    roles = {p.pid: role_of(p) for p in psutil.Process().children(recursive=True)}
    snap = Snapshot(t=time.monotonic(), total=gpu_used_mib())
    snap.server_alive = "server" in roles.values()
    snap.trainer_alive = "trainer" in roles.values()
    for pid, gpu, used in compute_apps():
        role = roles.get(pid)
        if role is not None:
            held = getattr(snap, role)
            held[gpu] = held.get(gpu, 0) + used
    return snap


class MemorySampler:
    """Takes a `snapshot()` every `interval` seconds in a thread while the `with` block runs."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.samples: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(snapshot())
            self._stop.wait(self.interval)

    def while_training(self) -> list[Snapshot]:
        """Samples in which the trainer held GPU memory (it was computing, not offloaded)."""
        return [s for s in self.samples if s.trainer_mib() > 0]


# --- rollouts ----------------------------------------------------------------------------------------------
PROMPTS = [
    "Write a line of Python.",
    "Name a module of the standard library.",
    "Say something about lists.",
    "Describe a dictionary.",
]


def vowel_share(text: str) -> float:
    """The reward: share of vowels among letters (varies a lot between random completions)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


async def rollout(client: Any, model_name: str, prompt: str, *, max_tokens: int = 24) -> Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=max_tokens, temperature=1.0, logprobs=True
    )
    choice = completion.choices[0]
    return Trajectory(
        messages_and_choices=[*messages, choice], reward=vowel_share(choice.message.content or "")
    )


async def make_groups(
    client: Any, model_name: str, *, groups: int = 2, size: int = 4, max_tokens: int = 24
) -> list[TrajectoryGroup]:
    """`groups` groups of `size` rollouts, all sent at once as ART programs gather them; a group whose rewards
    all tie gets a tie-breaker so every group carries a training signal."""

    async def group(prompt: str) -> TrajectoryGroup:
        trajectories = await asyncio.gather(
            *(rollout(client, model_name, prompt, max_tokens=max_tokens) for _ in range(size))
        )
        if len({t.reward for t in trajectories}) == 1:
            trajectories[0].reward += 1.0
        return TrajectoryGroup(trajectories)

    return list(await asyncio.gather(*(group(PROMPTS[g % len(PROMPTS)]) for g in range(groups))))


# --- SGLang's native API (what the OpenAI API does not expose) ----------------------------------------------
async def generate(
    base_url: str,
    input_ids: list[int],
    *,
    lora: str | None,
    max_new_tokens: int = 0,
    temperature: float = 1.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """POST /generate with token ids; returns meta_info with per-token logprobs (input and output)."""
    payload: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if seed is not None:
        payload["sampling_params"]["sampling_seed"] = seed
    if lora is not None:
        payload["lora_path"] = lora
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(f"{base_url}/generate", json=payload)
    response.raise_for_status()
    return response.json()


def output_logprobs(result: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of the sampled tokens in a /generate result."""
    triples = result["meta_info"]["output_token_logprobs"]
    return [int(t[1]) for t in triples], [float(t[0]) for t in triples]


def input_logprobs(result: dict[str, Any]) -> list[float]:
    """Logprobs of input tokens 1..n-1 (the first has none) from a /generate result."""
    return [float(t[0]) for t in result["meta_info"]["input_token_logprobs"][1:]]


def random_token_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def checkpoint_dirs(model_dir: Path) -> dict[int, Path]:
    """Complete checkpoints of a model's run dir: step -> folder."""
    found = {}
    for folder in (model_dir / "checkpoints").glob("[0-9][0-9][0-9][0-9]"):
        if (folder / "adapter_model.safetensors").exists():
            found[int(folder.name)] = folder
    return found


def recompute(script: Path, checkpoint: Path, work: Path, inputs: Any) -> dict[str, Any]:
    """Run a recompute script (its own process, so the trainer's stack loads there) on a copy of one step's
    `checkpoint` and `inputs` written as JSON; its report, the last line it printed."""
    shutil.copytree(checkpoint, work / "checkpoints" / checkpoint.name)
    (work / "inputs.json").write_text(json.dumps(inputs))
    done = subprocess.run(
        [sys.executable, str(script), str(work / "checkpoints"), str(work / "inputs.json")],
        capture_output=True, text=True, timeout=480, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
