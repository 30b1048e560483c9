"""Sampling parameters (SGLang's names, checks and messages, the stop regexes' length bound) and
next-token choice."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from art_sglang.sglang_env import ORIGINAL_LOGPROB_ENV

if sys.version_info >= (3, 11):
    from re import _parser as sre_parse
else:
    import sre_parse

_ORIGINAL_LOGPROB = os.environ.get(ORIGINAL_LOGPROB_ENV, "").lower() in ("1", "true")
UNBOUNDED = 2**30  # SGLang's bound for a regex match of any length: the whole output is searched


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message is SGLang's."""


class StopRegexError(Exception):
    """A `stop_regex` Python cannot parse. Not a ValueError: SGLang's request checks let the re.error
    escape (sampling_params.py `normalize`), so its routes answer 500, not 400."""


def stop_regex_bound(patterns: list[str]) -> int:
    """How many tokens a match of any of `patterns` can span (0 for none), as SGLang 0.5.17 bounds it
    (sampling_params.py `get_max_seq_length`): one token per character a pattern can match, UNBOUNDED for
    an unbounded repeat or a construct it does not measure (lookarounds, backreferences, negated
    characters). StopRegexError for a pattern that does not parse; ValueError (SGLang's 400 message) for
    one that parses but does not compile, which SGLang fails at its first check (schedule_batch.py
    `_check_str_based_finish`)."""
    bound = 0
    for pattern in patterns:
        try:
            bound = max(bound, _length_bound(sre_parse.parse(pattern)))
        except re.error as exc:
            raise StopRegexError(str(exc)) from exc
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid stop_regex {pattern!r}: {exc}") from exc
    return bound


def _length_bound(items: Any) -> int:
    """The most characters the parsed pattern `items` (sre_parse's (opcode, argument) list) can match."""
    total = 0
    for op, arg in items:
        if op in (sre_parse.LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif op == sre_parse.SUBPATTERN:
            total += _length_bound(arg[-1])
        elif op == sre_parse.BRANCH:
            total += max(_length_bound(branch) for branch in arg[1])
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            _, most, inner = arg
            total += UNBOUNDED if most == sre_parse.MAXREPEAT else most * _length_bound(inner)
        elif op != sre_parse.AT:  # ^, $ and \b match no character
            total += UNBOUNDED
    return total


@dataclass
class SamplingOptions:
    """How one sequence is sampled. `max_new_tokens=None` means up to the context length."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before temperature

    def verify(self) -> None:
        """Reject values SGLang rejects, with SGLang's messages (its `normalize` measures the stop regexes
        first, so a bad one fails before anything else)."""
        stop_regex_bound(self.stop_regex)
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise SamplingParamsError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def reported_logprobs(logits: torch.Tensor, sampled: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """The logprobs a response reports for a step whose draw used `sampled` (`logprobs_of`): with
    SGLANG_RETURN_ORIGINAL_LOGPROB set (read once at start, as SGLang does) taken before the temperature,
    else `sampled` itself."""
    if not _ORIGINAL_LOGPROB or options.greedy:  # greedy draws from the plain log-softmax already
        return sampled
    return _log_softmax(logits.float())


def logprobs_of(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Log-probabilities reported for a step: log-softmax of the logits divided by the temperature (as
    SGLang reports them; greedy requests get the plain log-softmax). Top-p/top-k do not renormalise them."""
    return _log_softmax(logits.float() if options.greedy else logits.float() / options.temperature)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # Clamped like SGLang's, so a masked (-inf) logit still serialises as a JSON number.
    return torch.log_softmax(logits, dim=-1).clamp(min=torch.finfo(torch.float32).min)


def choose_token(logprobs: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a draw from the top-k/top-p/min-p filtered distribution."""
    if options.greedy:
        return int(torch.argmax(logprobs))
    probs = logprobs.exp()
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if options.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep &= (sorted_probs.cumsum(0) - sorted_probs) < options.top_p
    if options.top_k > 0:
        keep[options.top_k :] = False
    if options.min_p > 0.0:
        keep &= sorted_probs >= sorted_probs[0] * options.min_p
    filtered = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    index = torch.multinomial(filtered / filtered.sum(), 1, generator=generator)
    return int(order[index])
