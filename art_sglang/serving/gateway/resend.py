"""Rollouts in flight across a merged-weight update (docs/merged-rollouts.md): a request on a name served
by the base slot (an alias: merged weights) that the update's `pause_generation("abort")` ended is sent
again as its continuation — `/generate` on the prompt's ids plus the ids sampled so far, with the rest of
its token budget and its own sampling parameters — and the answers are stitched into the one choice the
client gets: text, sampled ids, per-token logprobs, finish reason, usage. Each choice of such a request
carries `art_weight_versions`, the weight version (the served name, `<model>@<step>`, as the server
reports it) that sampled each run of its tokens, in order: `[{"version": "m@3", "tokens": 17},
{"version": "m@4", "tokens": 40}]`; the counts add up to the choice's completion tokens. The trainer reads
it to bound how far off-policy a rollout may be (`orchestration/off_policy.py`).

Only what the continuation reproduces exactly is resent: non-streamed chat and text completions whose
answer carries the prompt's and the sampled ids (`return_token_ids`, which the gateway asks for), without a
sampling constraint or tools (a grammar or a tool parser would start over on the continuation). The others
on an alias are drained before a push instead (`DRAINED`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from . import json_body
from .rules import CHAT_PATH

VERSIONS_FIELD = "art_weight_versions"  # on each returned choice
DRAINED = "!drained"  # in-flight key of alias requests that cannot be resent: a push waits for them
MAX_RESENDS = 8  # continuations of one choice (each update in flight ends one); then it stays cut off
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's `max_tokens` of /v1/completions when unset
# The request's sampling fields that /generate's `sampling_params` takes under the same name.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "skip_special_tokens",
    "no_stop_trim", "spaces_between_special_tokens",
)  # fmt: skip

# One continuation posted upstream: /generate body -> (status, answer body).
Post = Callable[[dict[str, Any]], Awaitable[tuple[int, bytes]]]


def continuation(path: str, payload: Mapping[str, Any], choice: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /generate body that samples the rest of the aborted `choice` of the request `payload` on
    `path`; None when nothing is left to sample (the budget is spent) or the ids to go on from are absent."""
    prompt, sampled = choice.get("prompt_token_ids"), choice.get("token_ids")
    if not isinstance(prompt, list) or not isinstance(sampled, list):
        return None
    if path == CHAT_PATH:
        logprobs, top = bool(payload.get("logprobs")), int(payload.get("top_logprobs") or 0)
    else:
        logprobs, top = payload.get("logprobs") is not None, int(payload.get("logprobs") or 0)
    remaining = budget_left(path, payload, len(sampled))
    if remaining is not None and remaining <= 0:
        return None
    params = {key: payload[key] for key in SAMPLING_FIELDS if payload.get(key) is not None}
    params["max_new_tokens"] = remaining
    return {
        "input_ids": prompt + sampled,
        "sampling_params": params,
        "return_logprob": logprobs,
        "top_logprobs_num": top,
        "return_text_in_logprobs": True,
    }


def budget_left(path: str, payload: Mapping[str, Any], sampled: int) -> int | None:
    """What is left of the request's token budget after `sampled` tokens (0 or less: spent; None: no budget,
    up to the context length)."""
    if path == CHAT_PATH:
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
    else:
        limit = payload.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    return None if limit is None else int(limit) - sampled


def stitch(path: str, choice: dict[str, Any], part: Mapping[str, Any], usage: dict[str, Any] | None) -> None:
    """Append the /generate answer `part` (a continuation of `choice`) to `choice`, and its tokens to
    `usage` and to the choice's version spans."""
    meta = part["meta_info"]
    ids = list(part.get("output_ids") or [])
    text = part.get("text") or ""
    if path == CHAT_PATH:
        message = choice.setdefault("message", {})
        message["content"] = (message.get("content") or "") + text
    else:
        choice["text"] = (choice.get("text") or "") + text
    choice["token_ids"] = list(choice.get("token_ids") or []) + ids
    if choice.get("logprobs") is not None:
        _append_logprobs(path, choice["logprobs"], meta)
    finish = meta.get("finish_reason") or {}
    choice["finish_reason"] = finish.get("type")
    choice["matched_stop"] = finish.get("matched") if finish.get("type") == "stop" else None
    if usage is not None:
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + len(ids)
        usage["total_tokens"] = usage.get("total_tokens", 0) + len(ids)
    choice[VERSIONS_FIELD] = add_span(choice.get(VERSIONS_FIELD) or [], meta.get("weight_version"), len(ids))


def add_span(spans: list[dict[str, Any]], version: str | None, tokens: int) -> list[dict[str, Any]]:
    """`spans` with `tokens` more sampled by `version` (joined to the last span when it is that version)."""
    if tokens == 0:
        return spans
    if spans and spans[-1]["version"] == version:
        return [*spans[:-1], {"version": version, "tokens": spans[-1]["tokens"] + tokens}]
    return [*spans, {"version": version, "tokens": tokens}]


def _append_logprobs(path: str, logprobs: dict[str, Any], meta: Mapping[str, Any]) -> None:
    """Extend a choice's logprobs (chat or text completion shape) by /generate's `output_token_logprobs`
    ([logprob, id, text] each) and `output_top_logprobs`."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [[] for _ in entries]
    if path == CHAT_PATH:
        logprobs.setdefault("content", [])
        for (logprob, _, text), top in zip(entries, tops, strict=True):
            alternatives = [{**_token(t), "logprob": lp} for lp, _, t in top]
            logprobs["content"].append({**_token(text), "logprob": logprob, "top_logprobs": alternatives})
        return
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        logprobs.setdefault(key, [])
    for (logprob, _, text), top in zip(entries, tops, strict=True):
        logprobs["tokens"].append(text or "")
        logprobs["token_logprobs"].append(logprob)
        logprobs["top_logprobs"].append({t or "": lp for lp, _, t in top})
        logprobs["text_offset"].append(-1)


def _token(text: str | None) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "bytes": list(text.encode("utf-8"))}


async def with_versions(path: str, payload: Mapping[str, Any], body: bytes, post: Post | None) -> bytes:
    """A completion's JSON `body` with each choice's version spans; with `post`, each choice that an update
    aborted is continued (up to `MAX_RESENDS` times) and stitched. A continuation the server refuses leaves
    the choice as it was cut (finish reason "abort")."""
    try:
        answer = json_body.loads(body)
        choices = answer["choices"]
    except (ValueError, KeyError, TypeError):
        return body
    version = (answer.get("metadata") or {}).get("weight_version")
    for choice in choices:
        sampled = choice.get("token_ids")
        tokens = len(sampled) if isinstance(sampled, list) else _logprob_count(path, choice)
        choice[VERSIONS_FIELD] = add_span([], version, tokens)
        for _ in range(MAX_RESENDS if post is not None else 0):
            if choice.get("finish_reason") != "abort":
                break
            request = continuation(path, payload, choice)
            if request is None:
                break
            assert post is not None
            status, raw = await post(request)
            if status != 200:
                break
            part = json_body.loads(raw)
            stitch(path, choice, part, answer.get("usage"))
            answer.setdefault("metadata", {})["weight_version"] = part["meta_info"].get("weight_version")
    return json_body.dumps(answer)


def _logprob_count(path: str, choice: Mapping[str, Any]) -> int:
    logprobs = choice.get("logprobs") or {}
    return len(logprobs.get("content" if path == CHAT_PATH else "tokens") or [])
