"""One generation's request and result as the reference engine's HTTP layer and model loop exchange
them, and the incremental decoding of its output text (stable text only, stop strings found)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .adapters import LoadedAdapter
from .sampling import SamplingOptions

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


class TextTracker:
    """Decodes output tokens incrementally, finds stop strings, and yields only text that can no longer
    change: an unfinished UTF-8 character or a possible start of a stop string is held back."""

    def __init__(self, decode: Callable[[list[int], bool], str], options: SamplingOptions) -> None:
        self._decode = decode
        self.options = options
        self.ids: list[int] = []
        self.emitted = 0
        self.final: str | None = None

    def decode(self) -> str:
        return self._decode(self.ids, self.options.skip_special_tokens)

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add a token; return (new stable text, matched stop string or None)."""
        self.ids.append(token_id)
        text = self.decode()
        hits = [(text.find(s), s) for s in self.options.stop if s and s in text]
        if hits:
            index, stop = min(hits)
            self.final = text[: index + len(stop)] if self.options.no_stop_trim else text[:index]
            delta = self.final[self.emitted :]
            self.emitted = len(self.final)
            return delta, stop
        safe = len(text.rstrip("\ufffd"))
        held = 0
        for stop in self.options.stop:
            for k in range(min(len(stop) - 1, safe), held, -1):
                if text[safe - k : safe] == stop[:k]:
                    held = k
                    break
        safe -= held
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta, None

    def finish(self) -> tuple[str, str]:
        """(the rest of the text not yet yielded, the whole text)."""
        text = self.final if self.final is not None else self.decode()
        rest = text[self.emitted :]
        self.emitted = len(text)
        return rest, text
