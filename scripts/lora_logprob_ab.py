"""Does a LoRA serving change keep SGLang's numbers? One real-vocabulary model and one random adapter, served
twice by SGLang launched as SGLangBackend launches it (`--flags backend`, no keys): the baseline
(`--baseline-env`: its environment, e.g. ART_SGLANG_BACKPORTS naming all default backports but one), then the
variant (`--variant-args`: SGLang flags added last; `--variant-env`: the server's environment);
`--baseline-args` adds flags to the baseline too (e.g. the variant without the one change under test), and
`--baseline-lora-backend` / `--(no-)baseline-lora-experimental-path` give it other LoRA kernels than the
variant's (`--lora-backend`, `--(no-)lora-experimental-path`, SGLangConfig's by default). Both
get the same requests, all at once so that decode runs in the CUDA graphs of ~`--requests` rows:

- decode: greedy answers of `--answer-tokens` to fixed prompt ids, with the logprob of every token chosen;
  compared position by position up to where the two answers part (they part only where two tokens' logits
  are within the variant's noise);
- forced: teacher-forced logprobs of fixed prompt and answer ids (`tests/backend/merged_checks.py`'s
  `forced_logprobs`, a prefill): every position compared;
- decode_vs_prefill, per server: its greedy answers' decode logprobs against its own teacher-forced prefill
  of the same prompt + answer ids, every position (same tokens by construction). Tells which server's decode
  departs from its prefill where the two servers' decodes differ more than their prefills do.

Prints and writes (--json) the largest and mean absolute logprob differences of each, how many decode steps
and prefill batches of each server ran in a CUDA graph (its log's lines) and the backports each server's
plugin applied. SGLang 0.5.17's triton LoRA backend keeps prefills of more than 32 requests out of its prefill
graphs: `--prompt-tokens 256` makes the 8,192-token chunks hold fewer.
  python scripts/lora_logprob_ab.py --model /root/models/qwen2.5-1.5b-random --sampling-backend pytorch \
      --baseline-env ART_SGLANG_BACKPORTS=json-response,gumbel-sampling,chat-template-memo
  python scripts/lora_logprob_ab.py --model /root/models/qwen2.5-1.5b-random --sampling-backend pytorch \
      --lora-backend triton --lora-experimental-path \
      --baseline-lora-backend csgmv --no-baseline-lora-experimental-path   # the triton path against csgmv
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "backend"))  # merged_checks
from bench_common import add_server_args, environment, make_random_adapter, markdown_table, write_results
from merged_checks import forced_logprobs, max_abs, mean_abs
from rollout_targets import ADAPTER, direct_targets

# Ordinary tokens of Qwen2.5's vocabulary (the random models keep its real ids), none of them special; a
# smaller vocabulary (the CPU test model's) bounds them by its size.
LOWEST_ID, HIGHEST_ID = 1_000, 30_000


def fixed_ids(seed: int, count: int, vocabulary: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(LOWEST_ID % vocabulary, min(HIGHEST_ID, vocabulary)) for _ in range(count)]


async def greedy_answer(http: httpx.AsyncClient, base_url: str, prompt: list[int], tokens: int) -> list[list]:
    """[logprob, token id] of each of `tokens` greedy answer tokens on the adapter."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
        "return_logprob": True,
        "lora_path": ADAPTER,
    }
    response = await http.post(f"{base_url}/generate", json=body)
    response.raise_for_status()
    return [
        [float(entry[0]), int(entry[1])] for entry in response.json()["meta_info"]["output_token_logprobs"]
    ]


def server_log_facts(log: str) -> dict[str, Any]:
    """From a server's log: its decode lines (one per 40 steps by default) in a CUDA graph and not, the
    largest batch, and the backports its plugin registered (the variant's environment reached it)."""
    lines = re.findall(r"Decode batch.*?#running-req: (\d+).*?cuda graph: (True|False)", log)
    prefills = re.findall(r"Prefill batch.*?cuda graph: (True|False)", log)
    backports = re.search(r"art_sglang backports on SGLang .*", log)
    return {
        "graph_lines": sum(graph == "True" for _, graph in lines),
        "eager_lines": sum(graph == "False" for _, graph in lines),
        "prefill_graph_lines": prefills.count("True"),
        "prefill_eager_lines": prefills.count("False"),
        "max_running": max((int(running) for running, _ in lines), default=0),
        "backports": backports.group(0) if backports else None,
    }


@contextlib.contextmanager
def server_environment(added: dict[str, str]) -> Iterator[None]:
    """The environment the server inherits (ServerProcess starts from this process's), with `added`."""
    kept = {key: os.environ.get(key) for key in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in kept.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def serve_and_ask(
    args: argparse.Namespace, side: str, flags: list[str], env: dict[str, str], lora: dict[str, Any]
) -> dict:
    """One side's answers; `lora`: its LoRA kernel settings where they differ from `args`."""
    adapter = make_random_adapter(
        args.model, args.workdir / f"adapter-r{args.lora_rank}", rank=args.lora_rank
    )
    side_args = argparse.Namespace(**{**vars(args), **lora, "sglang_args": [*args.sglang_args, *flags],
                                      "workdir": args.workdir / side})  # fmt: skip
    side_args.workdir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"versions": {}}
    vocabulary = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = [fixed_ids(i, args.prompt_tokens, vocabulary) for i in range(args.requests)]
    forced = [p + fixed_ids(10_000 + i, args.answer_tokens, vocabulary) for i, p in enumerate(prompts)]
    with server_environment(env):
        async with direct_targets(side_args, adapter, document) as targets:
            base_url = targets["server"].engine.base_url
            async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
                await greedy_answer(http, base_url, prompts[0], 4)  # warm-up: the adapter in the GPU pool
                answers = await asyncio.gather(
                    *(greedy_answer(http, base_url, p, args.answer_tokens) for p in prompts)
                )
            teacher = await asyncio.gather(*(forced_logprobs(base_url, ADAPTER, None, ids) for ids in forced))
            own = await asyncio.gather(*(forced_logprobs(base_url, ADAPTER, None, p + [t for _, t in a])
                                         for p, a in zip(prompts, answers, strict=True)))  # fmt: skip
    log = (side_args.workdir / f"server-{args.engine}.log").read_text(errors="replace")
    decoded = [lp for answer in answers for lp, _ in answer]
    prefilled = [lp for (row, _), p in zip(own, prompts, strict=True) for lp in row[len(p) - 1 :]]
    return {"answers": answers, "forced": [lp for lp, _ in teacher], "server_log": server_log_facts(log),
            "decode_vs_prefill": differences(decoded, prefilled),
            "launch": document.get("launch"), "versions": document["versions"]}  # fmt: skip


def compare(base: dict[str, Any], variant: dict[str, Any]) -> dict[str, Any]:
    decode_a: list[float] = []
    decode_b: list[float] = []
    parted = 0
    for one, other in zip(base["answers"], variant["answers"], strict=True):
        for (lp_a, id_a), (lp_b, id_b) in zip(one, other, strict=True):
            if id_a != id_b:
                parted += 1
                break
            decode_a.append(lp_a)
            decode_b.append(lp_b)
    forced_a = [lp for row in base["forced"] for lp in row]
    forced_b = [lp for row in variant["forced"] for lp in row]
    return {"decode": {**differences(decode_a, decode_b), "answers_parted": parted},
            "forced": differences(forced_a, forced_b)}  # fmt: skip


def differences(a: list[float], b: list[float]) -> dict[str, Any]:
    """Positions compared, and the largest and mean absolute difference (None where none were)."""
    return {
        "positions": len(a),
        "max_abs": max_abs(a, b) if a else None,
        "mean_abs": mean_abs(a, b) if a else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    baseline_env = dict(item.split("=", 1) for item in args.baseline_env)
    variant_env = dict(item.split("=", 1) for item in args.variant_env)
    asked = {"lora_backend": args.baseline_lora_backend,
             "lora_experimental_path": args.baseline_lora_experimental_path}  # fmt: skip
    baseline_lora = {key: value for key, value in asked.items() if value is not None}
    base = await serve_and_ask(args, "baseline", args.baseline_args, baseline_env, baseline_lora)
    variant = await serve_and_ask(args, "variant", args.variant_args, variant_env, {})
    return {
        "model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "answer_tokens": args.answer_tokens,
        "baseline": {"args": args.baseline_args, "env": baseline_env, "lora": baseline_lora},
        "variant": {"args": args.variant_args, "env": variant_env},
        **compare(base, variant),
        "decode_vs_prefill": {"baseline": base["decode_vs_prefill"], "variant": variant["decode_vs_prefill"]},
        "server_log": {"baseline": base["server_log"], "variant": variant["server_log"]},
        "launch": {"baseline": base["launch"], "variant": variant["launch"]},
        "versions": base["versions"], "environment": environment(),
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    def small(value: float | None) -> str:  # markdown_table would round a 1e-4 difference to 0
        return "-" if value is None else f"{value:.2e}"

    rows = [[kind, result[kind]["positions"], small(result[kind]["max_abs"]), small(result[kind]["mean_abs"])]
            for kind in ("decode", "forced")]  # fmt: skip
    rows += [[f"{side} decode vs its prefill", own["positions"], small(own["max_abs"]), small(own["mean_abs"])]
             for side, own in result["decode_vs_prefill"].items()]  # fmt: skip
    return markdown_table(["logprobs", "positions", "max |diff|", "mean |diff|"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.set_defaults(lora_rank=16, workdir=Path("/tmp/lora-logprob-ab"), beside_trainer=False)
    parser.add_argument("--variant-args", type=shlex.split, default=[], help="SGLang flags of the variant")
    parser.add_argument(
        "--baseline-env", nargs="*", default=[], metavar="KEY=VALUE", help="the baseline's env"
    )
    parser.add_argument("--variant-env", nargs="*", default=[], metavar="KEY=VALUE", help="the variant's env")
    parser.add_argument("--baseline-args", type=shlex.split, default=[], help="SGLang flags of the baseline")
    parser.add_argument("--baseline-lora-backend", default=None, help="the baseline's; unset: --lora-backend")
    parser.add_argument(
        "--baseline-lora-experimental-path",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the baseline's; unset: --(no-)lora-experimental-path",
    )
    parser.add_argument("--requests", type=int, default=200, help="sent at once: the decode graphs' batch")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=64)
    args = parser.parse_args()
    # SGLang as the backend launches it (its settled flags), without keys (the numbers do not depend on them).
    args.flags, args.drop, args.request_form, args.lora, args.weights, args.clients = (
        "backend", ["keys"], "gateway", True, "lora", ["bare"]
    )  # fmt: skip
    result = asyncio.run(run(args))
    write_results(args, result, table(result))
    print(json.dumps({key: result[key] for key in ("decode", "forced", "decode_vs_prefill", "server_log")}))


if __name__ == "__main__":
    main()
