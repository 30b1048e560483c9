"""Fixes from newer SGLang releases, backported to the SGLang that art_sglang launches: an SGLang general
plugin. This folder is put on the server's PYTHONPATH (nothing else in it), SGLang finds the entry point of
`art_sglang_backports-*.dist-info` (group `sglang.srt.plugins`) and calls `register()` in its HTTP process and
in each scheduler process. A backport applies only to releases before the one that fixed it; a fix no release
has yet applies to every release, and stays out of the default choice until a GPU measurement adopts it.

`ART_SGLANG_BACKPORTS` in the server's environment chooses them: `default` (unset: the ones marked default
below), `all`, `none`, or a comma list of the names below.

- `json-response` (fixed in 0.5.23): the OpenAI chat and completion routes hand their pydantic response to
  FastAPI, whose `jsonable_encoder` walks every element in Python: every token's logprob entry with its list
  of bytes, ~50 ms for a 1,024-token answer, one answer at a time in the one HTTP process. After a wave of
  GRPO rollouts the answers left that process seconds after the last token was sampled. Serialised in one
  pass by pydantic's own encoder instead (the same JSON): SGLang's rate +27 % with 128-token answers, +11 %
  with 1,024 (H100, 2026-11-28).
- `gumbel-sampling` (fixed in 0.5.23): `torch.multinomial` checks its input with two host-device syncs, which
  hold the scheduler's CPU work of the next decode step until the GPU has finished this one. Sampled by the
  Gumbel-max trick instead: the argmax of the probabilities divided by exponential noise, the same
  distribution, no sync. Seeded requests keep SGLang's own path. No change measured with 128–256 requests
  at once (H100, 2026-11-28); upstream measured +23 % at batch 32.
- `chat-template-memo` (in no release): the HTTP process applies the chat template and tokenizes every chat
  request on its event loop, ~2.7 ms for a 1,100-token prompt (CPU), though a GRPO group sends the same
  messages for each rollout. Memoised in a bounded LRU keyed on every input of that step
  (`art_sglang_chat_memo.py`; the same ids as SGLang's path on CPU for varied requests): merged mode's
  32 groups x 8 x 128-token waves +24 % output tokens/s with a bare client, +17 % with ART's (H200,
  2026-11-28).
- `chat-convert-thread` (fixed in 0.5.23): the HTTP process converted each chat request (template,
  tokenizing the whole prompt) inline on its event loop, ~3-4 ms for a ~1,300-token multi-turn conversation
  (CPU), the process sending no answer and reading no request meanwhile: a multi-turn wave's next turns
  reached the scheduler one by one (multiturn-64:32, H200: 256 turn-2 requests over 1.85 s, 1-4 per prefill,
  2026-11-28). Converted on one worker thread instead (`art_sglang_chat_thread.py`), as 0.5.23 and vLLM 0.24
  do: the Rust tokenizer releases the GIL while it encodes. On by default since 2026-11-28 (H200x4, one
  session, docs/benchmarks.md): multi-turn at 1.5B 8,510 output tok/s with it, 7,593 without it beside
  vLLM+LoRA's 8,079; at 7B 7,160 beside vLLM+LoRA's 7,018 (0.88x without it a session earlier).
- `csgmv-decode-grid` (in no release): csgmv's decode CUDA graph launched every LoRA kernel with one segment
  slot per request of the largest graph batch (256), ~94 % of them empty at bs 256 with one adapter; sized
  by the most segments a batch can have instead (`art_sglang_lora_grid.py`). Targets 0.5.17's
  `init_cuda_graph_batch_info` (0.5.23 renamed it). Decode logprobs identical to csgmv's as released
  (12,800 greedy tokens); SGLang's LoRA decode +15 %, its rate +6 % with 128-token answers and +11 % with
  1,024 (H200, 2026-11-28).
- `triton-prefill-grid` (fixed in 0.5.23): the triton LoRA backend's prefill CUDA graphs launched
  every LoRA kernel for 32 requests of the whole bucket each (8,192 rows), ~97 % of the CTAs empty, which
  halved its prefill rate against csgmv's (53k vs 99k tokens/s, H200, 2026-11-28); cut into the 16-row
  segments a batch can have instead (`art_sglang_triton_prefill.py`, beside this one), as 0.5.23's
  `prefill_cuda_graph_sgemm_batch_info` does. On by default; it changes nothing unless the triton backend
  runs (SGLangConfig(lora_backend='triton')). Prefill logprobs identical with it (63,800 positions).
- `evict-without-gc` (in no release): once the KV pool is full nearly every decode step evicts,
  and `RadixCache.evict` builds a (priority, node) tuple for every evictable leaf on each call (~10k with a
  full 1.5B pool on an H200). CPython's young collections run while the list is built, so the tuples reach
  the oldest generation, and its 25 % rule then starts a full collection (the whole scheduler heap, the
  radix tree included) far more often: with SGLang 0.5.17's own RadixCache on CPU (scripts/check_evict_gc.py,
  10k leaves, 1.5M long-lived objects) every ~110 decode steps, each starting inside an evict call, and
  never with this backport. Suspected cause of issue 39's ~0.5 s decode stalls every ~1.3 s,
  which began as the backend's KV pool filled. The call runs with the collector off; its tuples are freed
  by reference counting as it returns. On by default with `evict-ahead` (measured together, below). The
  heap's own O(leaves) per call stays; upstream's cure for that is a persistent lazy heap (sglang PR 38454,
  open; sglang-omni PR 1724 for this RadixCache).
- `evict-ahead` (in no release): with a full pool, SGLang 0.5.17 evicts only each step's
  shortfall (128 tokens for 128 requests), so nearly every decode step pays `evict`'s heap of every
  evictable leaf (~1–1.5 ms at 10k leaves on CPU, ~13 % of a 1.5B decode step: the backend's non-stalled
  intervals after its pool filled) and its promotions to the collector's oldest generation (above). A call
  for fewer tokens than 1/64 of the pool evicts that 1/64 instead (the least recently used leaves, which
  the next steps would evict anyway), so one call serves the next few hundred steps. On CPU through 0.5.17's
  own radix cache and allocator (`scripts/check_evict_gc.py`, 10k leaves, 3,072 decode steps): 20 evict
  calls instead of 1,989, no full collection (28 as released), eviction's cost per step 0.31 ms on average
  against 4.31 with `evict-without-gc` and 16.55 as released. The two together on SGLang (H200, 1.5B, 16
  groups x 8 x 128 tokens, 2026-11-28): 5-8 evict calls per 10-s run taking 0.05-0.08 s in all, against
  ~800 calls taking 13-14 s of each 30-s run as released; no decode stall in 146 log intervals against 39
  stalls of 0.52 s (35 % of decode time); output tokens/s 10,416 against 5,988, and 14,400 at 1,024-token
  answers (8,787 the session before, with the stalls).
- `logprob-json` (in no release): a non-streamed chat answer with logprobs is built with one
  validated pydantic entry per output token, and serialising it turns every entry into Python dicts again
  (the response's wrap serializers): ~4.4 ms of CPU per 1,024-token answer (SGLang 0.5.17's own classes, a
  CPU box), for each of a wave's 128 answers in turn on the HTTP process's one event loop, and the objects
  kept alive meanwhile start 4-5 full garbage collections of that process per wave (~0.5 s each). Built
  without the entries instead, their JSON written by pydantic-core from plain dicts into the body
  (`art_sglang_logprob_json.py`): the same bytes as `json-response` sends (scripts/check_logprob_json.py),
  ~1.1 ms. Over real HTTP on CPU a wave's last answer left 0.26-0.94 s after the first instead of 2.6-3.9 s.
  Answers with top logprobs or meta_info, and 0.5.23 (which takes `bytes` from the token id), keep SGLang's
  path. On by default since 2026-11-28; every answer of the twelfth session's GPU side-by-side went through it.

This module imports nothing of art_sglang (the server's venv need not have it) and no SGLang at import time
(art_sglang reads `selection` when it launches a server).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

SELECT_ENV = "ART_SGLANG_BACKPORTS"


async def _json_in_one_pass(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from fastapi.responses import Response
    from pydantic import BaseModel

    result = await original(*args, **kwargs)
    if isinstance(result, BaseModel):  # errors and streams are responses already
        return Response(content=result.model_dump_json(by_alias=True), media_type="application/json")
    return result


def _beside(module: str, function: str) -> Callable[..., Any]:
    """An AROUND hook that runs `function` of `module`, a module beside this one on the server's path,
    imported at the first call: art_sglang imports this module as part of its package (to check the
    selection), where a top-level import of its siblings would fail."""

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), function)(original, *args, **kwargs)

    hook.__qualname__ = f"{module}.{function}"  # what SGLang's hook registry names in its log
    return hook


def _gumbel_sample(
    original: Callable[..., Any], probs: Any, sampling_seed: Any = None, positions: Any = None
) -> Any:
    import torch

    if sampling_seed is not None:
        return original(probs, sampling_seed, positions)
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0)
    noise.clamp_min_(torch.finfo(torch.float32).tiny)  # a zero draw must not divide by zero
    return (probs.float() / noise).argmax(dim=-1).view(-1).to(torch.int32)


def _evict_without_gc(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not gc.isenabled():
        return original(*args, **kwargs)
    gc.disable()
    try:
        return original(*args, **kwargs)
    finally:
        gc.enable()


# evict-ahead: each evict call frees at least this share of the KV pool (1/64: ~37k tokens of a 2.4M pool).
EVICT_AHEAD_SHARE = 64


def _evict_ahead(original: Callable[..., Any], cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    floor = cache.token_to_kv_pool_allocator.size // EVICT_AHEAD_SHARE
    if 0 < params.num_tokens < floor:
        params = dataclasses.replace(params, num_tokens=floor)
    return original(cache, params, *args, **kwargs)


class Backport(NamedTuple):
    """A fix: the first release that has it (None: none yet), the functions it wraps with their wrappers,
    and whether the default choice applies it."""

    fixed_in: tuple[int, int, int] | None
    hooks: list[tuple[str, Callable[..., Any]]]
    default: bool = True


_TRITON = "sglang.srt.lora.backend.triton_backend.TritonLoRABackend"
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_COMPLETION = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion"
BACKPORTS: dict[str, Backport] = {
    "json-response": Backport(
        (0, 5, 23),
        [
            (f"{_CHAT}.handle_request", _json_in_one_pass),
            (f"{_COMPLETION}.handle_request", _json_in_one_pass),
        ],
    ),
    "gumbel-sampling": Backport(
        (0, 5, 23),
        [("sglang.srt.layers.sampler.sampling_from_probs_torch", _gumbel_sample)],
    ),
    "chat-template-memo": Backport(
        None, [(f"{_CHAT}._apply_jinja_template", _beside("art_sglang_chat_memo", "memoised_jinja_template"))]
    ),
    "chat-convert-thread": Backport(
        (0, 5, 23),
        [
            (f"{_CHAT}.handle_request", _beside("art_sglang_chat_thread", "convert_off_loop")),
            (f"{_CHAT}._convert_to_internal_request", _beside("art_sglang_chat_thread", "take_converted")),
        ],
    ),
    "csgmv-decode-grid": Backport(
        None,
        [
            (
                "sglang.srt.lora.backend.chunked_backend.ChunkedSgmvLoRABackend.init_cuda_graph_batch_info",
                _beside("art_sglang_lora_grid", "right_size_decode_segments"),
            )
        ],
    ),
    "triton-prefill-grid": Backport(
        (0, 5, 23),
        [
            (
                f"{_TRITON}.init_prefill_cuda_graph_batch_info",
                _beside("art_sglang_triton_prefill", "widen_prefill_segments"),
            ),
            (f"{_TRITON}.prepare_lora_batch", _beside("art_sglang_triton_prefill", "cut_prefill_rows")),
        ],
    ),
    "evict-without-gc": Backport(
        None, [("sglang.srt.mem_cache.radix_cache.RadixCache.evict", _evict_without_gc)]
    ),
    "evict-ahead": Backport(None, [("sglang.srt.mem_cache.radix_cache.RadixCache.evict", _evict_ahead)]),
    "logprob-json": Backport(
        None,
        [(f"{_CHAT}._build_chat_response", _beside("art_sglang_logprob_json", "build_in_one_pass"))],
    ),
}


def selection(raw: str | None) -> list[str]:
    """The backports `raw` (the value of `ART_SGLANG_BACKPORTS`, None: unset) chooses; ValueError on a name
    that is none of them."""
    value = (raw or "default").strip()
    if value == "default":
        return [name for name, backport in BACKPORTS.items() if backport.default]
    if value == "all":
        return list(BACKPORTS)
    if value == "none":
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKPORTS]
    if unknown:
        raise ValueError(
            f"{SELECT_ENV}={raw!r} names no backport {unknown}: give 'default', 'all', 'none' or a comma list of "
            f"{sorted(BACKPORTS)}"
        )
    return names


def without(names: str) -> str:
    """The `ART_SGLANG_BACKPORTS` value that chooses the default backports but `names` (one, or a comma list;
    `none` if no other)."""
    left_out = {name.strip() for name in names.split(",")}
    return ",".join(other for other in selection(None) if other not in left_out) or "none"


def release(version: str) -> tuple[int, int, int]:
    """`0.5.17`, `0.5.17.post1`, `0.5.23rc0` -> their (major, minor, patch)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a release number: {version!r}")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def register() -> None:
    """SGLang's plugin hook: register the chosen backports its release lacks (applied by SGLang next)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.version import __version__

    running = release(__version__)
    registered = []
    for name in selection(os.environ.get(SELECT_ENV)):
        backport = BACKPORTS[name]
        if backport.fixed_in is None or running < backport.fixed_in:
            for target, wrapper in backport.hooks:
                HookRegistry.register(target, wrapper, HookType.AROUND)
            fixed = (
                "in no release yet"
                if backport.fixed_in is None
                else "in " + ".".join(map(str, backport.fixed_in))
            )
            registered.append(f"{name} (fixed {fixed})")
    # Printed, not logged: SGLang loads plugins before it sets up logging, so an INFO record would be lost.
    print(
        f"art_sglang backports on SGLang {__version__}: {', '.join(registered) or 'none'}",
        file=sys.stderr,
        flush=True,
    )
