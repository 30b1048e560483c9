"""Pieces of SGLang's OpenAI responses shared by the whole and the streamed answers: usage, the finish
reason with its matched stop, and token logprobs in the chat and text completion shapes."""

from __future__ import annotations

from typing import Any

from .engine import ReferenceEngine
from .generation import GenerationResult, TokenLogprob


def usage(results: list[GenerationResult], n: int, cache_report: bool) -> dict[str, Any]:
    """SGLang's usage: prompt and cached tokens counted once per prompt, completions for every choice."""
    firsts = results[::n]
    prompt = sum(len(r.prompt_ids) for r in firsts)
    completion = sum(len(r.output_ids) for r in results)
    cached = sum(r.cached_tokens for r in firsts)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cache_report and cached > 0 else None,
        "reasoning_tokens": 0,
    }


def finish_fields(result: GenerationResult) -> tuple[str, int | str | None]:
    return result.finish.type, result.finish.matched if result.finish.type == "stop" else None


def _token_fields(engine: ReferenceEngine, token_id: int, logprob: float) -> dict[str, Any]:
    text = engine.token_text(token_id)
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def chat_logprob(engine: ReferenceEngine, entry: TokenLogprob) -> dict[str, Any]:
    return {
        **_token_fields(engine, entry.token_id, entry.logprob),
        "top_logprobs": [_token_fields(engine, i, lp) for i, lp in entry.top],
    }


def completion_logprobs(engine: ReferenceEngine, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [engine.token_text(e.token_id) for e in entries],
        "top_logprobs": [{engine.token_text(i): lp for i, lp in e.top} for e in entries],
    }
