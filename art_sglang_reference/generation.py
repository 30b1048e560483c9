"""One generation's request and result as the reference engine's HTTP layer and model loop exchange
them, and the incremental decoding of its output text (stable text only, where it stops)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .adapters import LoadedAdapter
from .sampling import SamplingOptions, stop_regex_bound

if TYPE_CHECKING:
    import torch


class TokenGrammar(Protocol):
    """A constraint on the next token the engine's loop applies (constrained.StructuredGrammar)."""

    def mask(self, eos_ids: set[int]) -> torch.Tensor: ...

    def advance(self, token: int) -> None: ...


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class FinishReason:
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None

    def as_sglang(self) -> dict[str, Any]:
        """`meta_info.finish_reason` of SGLang's /generate."""
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": self.matched}


DeltaCallback = Callable[[str, TokenLogprob | None], None]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingOptions
    adapter_name: str | None = None
    top_logprobs: int = 0
    input_logprob_start: int | None = None  # None: no prompt logprobs
    on_delta: DeltaCallback | None = None  # streamed text pieces (and the token they came with)
    abort: threading.Event | None = None
    # Tokens that leave it are masked: a regex/ebnf/json_schema grammar, or a tool_choice's (tool_choice.py).
    grammar: TokenGrammar | None = None
    # One of a request's n > 1 choices: SGLang prefills such a prompt with a copy first.
    parallel: bool = False


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish: FinishReason
    output_logprobs: list[TokenLogprob]
    input_logprobs: list[TokenLogprob | None]
    cached_tokens: int
    adapter: LoadedAdapter | None
    started: float
    finished: float
    # The weights' version as the request finished (read under the model lock: an update waiting for it has
    # not run yet), as SGLang reports it.
    weight_version: str


class TextCodec(Protocol):
    """The tokenizer calls of a TextTracker (the engine's, which serialise tokenizer use)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def count_tokens(self, text: str) -> int: ...


class TextTracker:
    """Decodes a generation's output tokens, says where it ends as SGLang 0.5.17 does, and yields only
    text that can no longer change: an unfinished UTF-8 character is held back, and everything new while
    the stop window ends in the start of a stop string (SGLang's stream sends nothing then).

    SGLang looks for stop strings and regexes only in the text of the last W tokens, W = the longest of
    the stop strings' token counts (their canonical tokenization) and the regexes' length bounds, plus 1
    (schedule_batch.py `_stop_match_tail_len`, `tail_str`, `_check_str_based_finish`): a stop string the
    model spells in more tokens than W is never seen."""

    def __init__(self, codec: TextCodec, options: SamplingOptions, stop_ids: set[int]) -> None:
        self._codec = codec
        self.options = options
        self._stop_ids = stop_ids
        self._regexes = [re.compile(pattern) for pattern in options.stop_regex]
        longest = max((codec.count_tokens(stop) for stop in options.stop), default=0)
        self._window = max(longest, stop_regex_bound(options.stop_regex)) + 1
        self.ids: list[int] = []
        self.emitted = 0
        self.final: str | None = None

    def decode(self) -> str:
        return self._codec.decode(self.ids, self.options.skip_special_tokens)

    def push(self, token_id: int, at_limit: bool) -> tuple[str, FinishReason | None]:
        """Add a token (the last one allowed if `at_limit`); return (new stable text, why the generation
        ends here or None)."""
        self.ids.append(token_id)
        # SGLang's tail_str: decoded with special tokens kept, whatever the request skips.
        tail = self._codec.decode(self.ids[-self._window :], False) if self._searched else ""
        finish = self._finish(token_id, tail, at_limit)
        if finish is not None:
            self.final = self._final_text(finish)
            return self._take(self.final, len(self.final)), finish
        if self._holds_back(tail):
            return "", None
        text = self.decode()
        return self._take(text, len(text.rstrip("\ufffd"))), None

    def finish(self) -> tuple[str, str]:
        """(the rest of the text not yet yielded, the whole text)."""
        text = self.final if self.final is not None else self.decode()
        rest = text[self.emitted :]
        self.emitted = len(text)
        return rest, text

    @property
    def _searched(self) -> bool:
        return bool(self.options.stop or self._regexes)

    def _finish(self, token_id: int, tail: str, at_limit: bool) -> FinishReason | None:
        # SGLang's order (schedule_batch.py `update_finish_state`): the length limit, stop strings in list
        # order, stop regexes, then stop tokens (none with ignore_eos: `stop_ids` is empty then).
        if at_limit:
            return FinishReason("length", length=len(self.ids))
        for stop in self.options.stop:
            if stop in tail:
                return FinishReason("stop", matched=stop)
        for regex in self._regexes:
            if regex.search(tail):
                return FinishReason("stop", matched=regex.pattern)
        if token_id in self._stop_ids:
            return FinishReason("stop", matched=token_id)
        return None

    def _final_text(self, finish: FinishReason) -> str:
        """The text SGLang's detokenizer returns (detokenizer_manager.py `trim_matched_stop`): without the
        stop token, and cut at the first occurrence of the matched string (a regex's own text, which a
        match seldom spells) in the whole text; `no_stop_trim` keeps the token, and the string up to its
        end."""
        keep, matched = self.options.no_stop_trim, finish.matched
        if isinstance(matched, int):
            return self._codec.decode(self.ids if keep else self.ids[:-1], self.options.skip_special_tokens)
        text = self.decode()
        if not matched or (position := text.find(matched)) == -1:
            return text
        return text[: position + len(matched)] if keep else text[:position]

    def _holds_back(self, tail: str) -> bool:
        """Whether the window ends in the start of a stop string (schedule_batch.py
        `check_match_stop_str_prefix`; regexes hold nothing back)."""
        return any(
            tail.endswith(stop[:k])
            for stop in self.options.stop
            for k in range(1, min(len(tail), len(stop)) + 1)
        )

    def _take(self, text: str, end: int) -> str:
        delta = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
