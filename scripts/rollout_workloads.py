"""The workloads of `bench_rollouts.py`: what a run (`KIND-TOKENS:GROUPS[@CLIENT]`) sends, wave by wave,
and on which configurations of a side (route, prefill-sharing setting, client) it runs."""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from benchmark_inference import Conversation
from rollout_targets import CLIENTS, Target

KINDS = ("grpo", "varying", "multiturn")
# Most wanted first, so a run cut by --deadline-s has them (issue 39: 32 and 16 groups of 128 tokens,
# 16 groups of 1,024, answers of varying length, multi-turn).
DEFAULT_RUNS = ("grpo-128:32", "grpo-128:16", "grpo-1024:16", "varying-384:32", "multiturn-64:32")


@dataclass(frozen=True)
class RunSpec:
    """One workload: `kind` (grpo, varying, multiturn), its tokens per answer, its number of groups, and
    the clients it runs with (empty: every `--clients`)."""

    kind: str
    tokens: int
    groups: int
    clients: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.tokens}:{self.groups}"


def run_spec(text: str) -> RunSpec:
    """`KIND-TOKENS:GROUPS[@CLIENT]`, e.g. `grpo-128:32` or `grpo-1024:16@bare`."""
    text, _, client = text.partition("@")
    head, _, groups = text.partition(":")
    kind, _, tokens = head.partition("-")
    if kind not in KINDS or not tokens.isdigit() or not groups.isdigit() or client not in ("", *CLIENTS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use KIND-TOKENS:GROUPS[@CLIENT] with KIND in {KINDS}, CLIENT in {CLIENTS}"
        )
    return RunSpec(kind, int(tokens), int(groups), (client,) if client else ())


class Setting(NamedTuple):
    """One configuration of a workload on a live side: route, prefill-sharing setting, client."""

    route: str
    merging: str | None
    client: str


def run_settings(spec: RunSpec, targets: dict[str, Target], args: argparse.Namespace) -> list[Setting]:
    """The configurations `spec` runs on these targets."""
    wanted = ["on", "off"] if spec.kind in args.off_kinds else ["on"]
    return [
        Setting(route, merging, client)
        for route, target in targets.items()
        for merging in target.merge_settings(wanted)
        for client in spec.clients or args.clients
        if client in target.senders
    ]


def eos_bias(model: str, mean_tokens: float) -> dict[str, float]:
    """`logit_bias` on the model's end-of-sequence tokens that makes a model with near-uniform next-token
    probabilities (random weights) end after ~`mean_tokens` tokens: P(eos) = 1 / mean_tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    ids = {AutoTokenizer.from_pretrained(model).eos_token_id}
    with contextlib.suppress(OSError):  # a model folder without generation_config.json
        found = GenerationConfig.from_pretrained(model).eos_token_id
        ids |= set(found) if isinstance(found, list) else {found}
    ids.discard(None)
    bias = math.log((vocab - len(ids)) / (len(ids) * max(mean_tokens - 1, 1.0)))
    return {str(i): round(bias, 3) for i in sorted(ids)}


async def rollout(
    target: Target, client: str, messages: list[dict[str, str]], spec: RunSpec, bias: dict[str, float]
) -> dict[str, Any]:
    """One rollout request as ART sends it: its latency, text, tokens and cached prompt tokens."""
    extra: dict[str, Any] = {"ignore_eos": True} if spec.kind != "varying" else {"logit_bias": bias}
    start = time.perf_counter()
    result = await target.senders[client].chat(target.body(messages, spec.tokens, extra))
    return {**result, "latency_s": time.perf_counter() - start}


def wave(spec: RunSpec, args: argparse.Namespace, tag: str, body: str) -> list[Conversation]:
    """One wave of `spec`: `group_size` conversations per group, the group's prompt shared."""
    turns = args.turns if spec.kind == "multiturn" else 1
    return [
        Conversation(
            f"{tag} group {g}. {body}", tuple(f"Turn {t} of game {g}: your move?" for t in range(turns))
        )
        for g in range(spec.groups)
        for _ in range(args.group_size)
    ]
