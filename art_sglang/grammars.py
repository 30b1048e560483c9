"""Structured-output grammars (regex, EBNF, JSON schema; structural tags of tool_choice) token by token
with xgrammar, SGLang's default grammar backend: which tokens a grammar allows next and how it advances
over a sampled token. The trainer replays a rollout's grammar over its sampled ids with it; the reference
engine samples under it.

xgrammar is optional (the `[grammars]` extra): without it `available()` is False, the
trainer refuses grammar-constrained rollouts and the reference engine answers grammar requests with 400
(`constraints.grammars_available()`, which needs no torch).
The vocabulary is the model's (SGLang builds xgrammar's tokenizer info with the model config's vocab size
and the model's end-of-sequence ids as stop tokens, which end a grammar once it is complete).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .constraints import Grammar, SamplingConstraint

BITS = 32  # xgrammar's token bitmask packs 32 tokens in each int32


class GrammarError(ValueError):
    """The grammar does not compile, or a token it does not allow was given to it."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer (xgrammar's compiler caches compiled grammars)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        self._compiler = xgrammar.GrammarCompiler(info)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        return self._matcher(grammar.kind, grammar.source)

    def structural_tag_matcher(self, source: str) -> GrammarMatcher:
        """SGLang's legacy structural tag (JSON text: `structures` of begin/schema/end, `triggers`,
        `at_least_one`), compiled as SGLang's xgrammar backend compiles the tag of a tool_choice."""
        return self._matcher("structural_tag", source)

    def _matcher(self, kind: str, source: str) -> GrammarMatcher:
        try:
            if kind == "regex":
                compiled = self._compiler.compile_regex(source)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(source)
            elif kind == "structural_tag":
                compiled = self._compiler.compile_structural_tag(_legacy_structural_tag(source))
            else:
                compiled = self._compiler.compile_json_schema(source)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"the {kind} grammar does not compile: {exc}") from exc
        return GrammarMatcher(compiled, self.vocab_size)


def _legacy_structural_tag(source: str) -> Any:
    """xgrammar's form of a legacy structural tag, as SGLang's `dispatch_structural_tag` builds it: triggered
    tags, each a begin, a JSON schema (`{}`: any JSON value) and an end."""
    import xgrammar

    tag = json.loads(source)
    items = [
        xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    structural = xgrammar.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    structural.format.at_least_one = bool(tag.get("at_least_one", False))
    return structural


class GrammarMatcher:
    """One generation's position in a grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def bitmask(self) -> torch.Tensor:
        """The tokens allowed next, packed (int32, 32 tokens each); all zero once the grammar ended."""
        if self._matcher.is_terminated():
            return torch.zeros_like(self._bitmask[0])
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].clone()

    def advance(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar at this point")


def unpack(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bitmasks [..., words] → bool masks [..., vocab_size] (True: allowed)."""
    shifts = torch.arange(BITS, device=bitmasks.device, dtype=torch.int32)
    bits = (bitmasks.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def allows(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // BITS]) >> (token % BITS)) & 1)


@dataclass(frozen=True, eq=False)
class GrammarStep:
    """The constraint of one sampled token of a grammar-constrained rollout: the tokens the grammar allowed
    at its position (packed), and the rest of the rollout's constraint (bias, allowed set)."""

    bitmask: torch.Tensor
    base: SamplingConstraint | None = None


# A sampled token's constraint: the rollout's (bias, allowed set), or one step of its grammar.
TokenConstraint = SamplingConstraint | GrammarStep


def replay(matcher: GrammarMatcher, ids: list[int], base: SamplingConstraint | None) -> list[GrammarStep]:
    """Each sampled token's step, the grammar advanced over them (GrammarError at a token it refuses)."""
    steps = []
    for token in ids:
        steps.append(GrammarStep(matcher.bitmask(), base))
        matcher.advance(token)
    return steps
