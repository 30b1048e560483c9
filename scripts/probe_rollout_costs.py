"""Where a wave of ART-style rollouts spends its time on one engine server: the same GRPO waves (G groups x
`--group-size` chat requests, one identical ~`--prompt-tokens` prompt per group, all at once, a random LoRA
on every request, `ignore_eos`) sent in several ways, each for at least `--seconds`:

- `art-client`: ART's client (`AsyncOpenAI` on httpx, as `art.Model.openai_client()` builds it), logprobs on;
- `art-client-aiohttp`: the same SDK on aiohttp (`openai.DefaultAioHttpClient`);
- `raw`: each request posted with a bare aiohttp session (near-zero client cost), logprobs on;
- `raw-nologprobs`: the same without logprobs;
- `raw-n`: one request per group asking `n=group_size` (the engine computes the prompt once);
- `raw-prefill-first`: per group a prompt-only request (`max_tokens` 0) first, then the group;
- `gateway` / `gateway-share`: ART's client through this project's gateway in this process, prefill sharing
  off / on.

Per way: output tokens/s, the cached share of prompt tokens, CPU seconds of this process and of each
server process (by name) over the run. It starts the engine directly (`scripts/inference_engines.py`) and
never unloads the adapter (an `n>1` request on an adapter leaves SGLang 0.5.17 unable to unload it).
`--profile-way WAY --profile-dir DIR` samples every server process with py-spy while WAY is measured.

    python scripts/probe_rollout_costs.py --model /root/models/qwen2.5-1.5b-shape --sampling-backend pytorch \\
        --json costs.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_server_args,
    art_openai_client,
    environment,
    make_random_adapter,
    server_settings,
)
from inference_engines import EngineServer

from art_sglang.serving.gateway.app import AdapterGateway

ADAPTER = "probe"
WAYS = (
    "art-client",
    "art-client-aiohttp",
    "raw",
    "raw-nologprobs",
    "raw-n",
    "raw-prefill-first",
    "gateway",
    "gateway-share",
)


def server_processes(root: int) -> dict[int, tuple[str, float]]:
    """`root` and its descendants: pid -> (name, CPU seconds so far). SGLang names its scheduler and
    detokenizer processes (in their command line)."""
    tree = {}
    try:
        top = psutil.Process(root)
        processes = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return tree
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied), process.oneshot():
            command, times = process.cmdline(), process.cpu_times()
            name = command[0].rsplit("/", 1)[-1] if command and command[0] else process.name()
            tree[process.pid] = (name, times.user + times.system)
    return tree


def process_cpu(root: int) -> Counter[str]:
    """CPU seconds so far of the server's processes, summed by name."""
    totals: Counter[str] = Counter()
    for name, seconds in server_processes(root).values():
        totals[name] += seconds
    return totals


def start_profiles(root: int, seconds: float, out: Path) -> list[subprocess.Popen]:
    """py-spy sampling each server process for `seconds` (raw flamegraph text per process)."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "--nonblocking",
                "-p",
                str(pid),
                "-d",
                str(int(seconds)),
                "-r",
                "50",
                "-f",
                "raw",
                "-o",
                str(out / f"{name.replace(':', '_')}-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for pid, (name, _) in server_processes(root).items()
    ]


class Prober:
    """Sends the waves of one way and measures them."""

    def __init__(self, args: argparse.Namespace, server: EngineServer) -> None:
        self.args = args
        self.server = server
        self.model = server.adapter_model(ADAPTER)
        self.prompt = " ".join(f"w{i % 97}" for i in range(args.prompt_tokens // 2))
        self.session: aiohttp.ClientSession | None = None

    def body(self, tag: str, group: int, **changes: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": f"{tag} group {group}. {self.prompt}"}],
            "max_tokens": self.args.tokens,
            "temperature": 1.0,
            "logprobs": True,
            "ignore_eos": True,
            **changes,
        }

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.post(url + "/v1/chat/completions", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {str(payload)[:300]}")
            return payload

    async def openai(self, client: AsyncOpenAI, body: dict[str, Any]) -> dict[str, Any]:
        standard = {k: body[k] for k in ("model", "messages", "max_tokens", "temperature", "logprobs")}
        response = await client.chat.completions.create(**standard, extra_body={"ignore_eos": True})
        return response.model_dump()

    async def wave(self, way: str, tag: str, send: Callable[[dict[str, Any]], Awaitable[dict]]) -> list[dict]:
        groups, size = self.args.groups, self.args.group_size
        if way == "raw-n":
            return await asyncio.gather(*(send(self.body(tag, g, n=size)) for g in range(groups)))
        if way == "raw-prefill-first":

            async def group(g: int) -> list[dict]:
                await send(self.body(tag, g, max_tokens=0, logprobs=False))
                return await asyncio.gather(*(send(self.body(tag, g)) for _ in range(size)))

            return [
                answer for part in await asyncio.gather(*(group(g) for g in range(groups))) for answer in part
            ]
        changes = {"logprobs": False} if way == "raw-nologprobs" else {}
        return await asyncio.gather(
            *(send(self.body(tag, g, **changes)) for g in range(groups) for _ in range(size))
        )

    async def measure(self, way: str, round_: int) -> dict[str, Any]:
        url, gateway, client = self.server.base_url, None, None
        if way.startswith("gateway"):
            gateway = AdapterGateway(url, share_lead=0.003 if way == "gateway-share" else None)
            gateway.set_served([ADAPTER], base_ids=[self.args.model])
            gateway.start()
            url = gateway.base_url
        if way.startswith(("art-client", "gateway")):
            client = art_openai_client(f"{url}/v1", "none", aiohttp_transport=way == "art-client-aiohttp")

            async def send(body: dict[str, Any]) -> dict[str, Any]:
                assert client is not None
                return await self.openai(client, body)
        else:

            async def send(body: dict[str, Any]) -> dict[str, Any]:
                return await self.post(url, body)

        await self.wave(way, f"warm {way} {round_}", send)
        pid = self.server.process.pid
        assert pid is not None
        profiles = []
        if way == self.args.profile_way and self.args.profile_dir is not None:
            if shutil.which("py-spy"):
                profiles = start_profiles(pid, self.args.seconds, self.args.profile_dir)
            else:
                print(f"no profile of {way}: py-spy is not on PATH", flush=True)
        server_before, own_before = process_cpu(pid), time.process_time()
        start, answers, waves = time.perf_counter(), [], 0
        while time.perf_counter() - start < self.args.seconds:
            answers += await self.wave(way, f"{way} {round_} wave {waves}", send)
            waves += 1
        elapsed = time.perf_counter() - start
        own = time.process_time() - own_before
        server = process_cpu(pid)
        server.subtract(server_before)
        for profile in profiles:
            profile.wait()
        if client is not None:
            await client.close()
        if gateway is not None:
            gateway.close()
        completion = sum(a["usage"]["completion_tokens"] for a in answers)
        prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
        cached = sum(
            (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for a in answers
        )
        return {
            "way": way,
            "round": round_,
            "waves": waves,
            "seconds": round(elapsed, 3),
            "wave_s": round(elapsed / waves, 3),
            "output_tokens_per_s": round(completion / elapsed, 1),
            "cached_share": round(cached / prompt, 4) if prompt else None,
            "client_cpu_s": round(own, 2),
            "server_cpu_s": {name: round(seconds, 2) for name, seconds in server.most_common()},
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    document: dict[str, Any] = {"environment": environment(), "args": vars(args), "runs": []}
    adapter = make_random_adapter(args.model, args.workdir / "adapter", rank=args.lora_rank)
    server = EngineServer(args.engine, server_settings(args), log_path=args.workdir / "server.log")
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        try:
            await server.start()
            document["command"] = server.command()
            await server.load_adapter(http, ADAPTER, adapter)
            prober = Prober(args, server)
            # Idle connections are dropped before the server's 5 s keep-alive closes them under a request.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
            async with aiohttp.ClientSession(connector=connector) as session:
                prober.session = session
                for round_ in range(args.repeats):
                    for way in args.ways:
                        entry = await prober.measure(way, round_)
                        print(json.dumps(entry), flush=True)
                        document["runs"].append(entry)
                        if args.json is not None:
                            args.json.write_text(json.dumps(document, indent=1, default=str))
        finally:
            await server.stop()
    return document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser, engines=("sglang", "reference", "vllm"))
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=1100)
    parser.add_argument("--seconds", type=float, default=8.0, help="each way sends waves for this long")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--profile-way", choices=WAYS, default=None, help="sample the server with py-spy here"
    )
    parser.add_argument("--profile-dir", type=Path, default=None, help="where py-spy's samples go")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
