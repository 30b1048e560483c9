"""SGLang's sampling constraints on the OpenAI routes: `logit_bias`, the regex / ebnf / json_schema /
response_format grammars and the grammar of a tool_choice, applied where SGLang applies them. SGLang's
model runner adds the bias and masks the grammar's disallowed tokens on the raw logits
(`_preprocess_logits` → `apply_logits_bias`) before its sampler takes the logprobs
(sampling.reported_logprobs), so the reported logprob of a sampled token is its probability under the
constraint; the engine's loop does the same. Grammars go through xgrammar (SGLang's default backend),
which is optional here: without it a grammar request is a 400, never an unconstrained sample.
`allowed_token_ids` is not an SGLang field and is ignored, as SGLang ignores it (the gateway forwards it
as logit_bias). A custom logit processor is refused (SGLang refuses it too unless launched with
--enable-custom-logit-processor)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from art_sglang import grammars
from art_sglang.constraints import GRAMMAR_FIELDS, Grammar, constraint_of, grammars_available

from .generation import GenerationRequest


class ReferenceEngine(Protocol):
    """What constraints read of the engine (engine.py imports this module, so not the class itself)."""

    tokenizer: Any
    hf_config: Any
    eos_ids: set[int]


_FIELDS = ("logit_bias", "custom_logit_processor", "response_format", "structural_tag", *GRAMMAR_FIELDS)


class StructuredGrammar:
    """A grammar in the engine's loop (generation.TokenGrammar): xgrammar's mask and advance."""

    def __init__(self, matcher: grammars.GrammarMatcher) -> None:
        self._matcher = matcher

    def mask(self, eos_ids: set[int]) -> torch.Tensor:
        # xgrammar allows the stop tokens it was built with once the grammar is complete.
        return grammars.unpack(self._matcher.bitmask(), self._matcher.vocab_size)

    def advance(self, token: int) -> None:
        self._matcher.advance(token)


def constrain(engine: ReferenceEngine, fields: Mapping[str, Any], requests: list[GenerationRequest]) -> None:
    """Set the request body's constraint on each generation; ValueError (a 400) for a bad one."""
    constraint = constraint_of({key: fields.get(key) for key in _FIELDS})
    if constraint is None:
        return
    vocab = int(engine.hf_config.vocab_size)
    outside = [t for t, _ in constraint.logit_bias if t >= vocab]
    if outside:
        raise ValueError(f"logit_bias names token {outside[0]}, outside the vocabulary (0..{vocab - 1})")
    for request in requests:
        request.sampling.logit_bias = dict(constraint.logit_bias)
        if constraint.grammar is not None:
            _require_xgrammar(f"a {constraint.grammar.kind} grammar")
            request.grammar = StructuredGrammar(_compiler(engine).matcher(constraint.grammar))


def constrain_tools(
    engine: ReferenceEngine, constraint: Grammar | None, requests: list[GenerationRequest]
) -> None:
    """Set the tool_choice's constraint on each generation without a grammar of its own: SGLang drops the
    tool constraint of a request that has one ("Constrained decoding is not compatible with tool calls.")."""
    pending = [request for request in requests if request.grammar is None]
    if constraint is None or not pending:
        return
    _require_xgrammar(f"the {constraint.kind} grammar of a tool_choice")
    compiler = _compiler(engine)
    for request in pending:
        request.grammar = StructuredGrammar(compiler.matcher(constraint))


def _require_xgrammar(what: str) -> None:
    if not grammars_available():
        raise ValueError(f"{what} needs xgrammar on the reference engine: pip install 'art-sglang[grammars]'")


@functools.cache
def _compiler(engine: ReferenceEngine) -> grammars.GrammarCompiler:
    return grammars.GrammarCompiler(engine.tokenizer, int(engine.hf_config.vocab_size), engine.eos_ids)


def biased(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    """`logits` with `bias` added to the named tokens (a copy)."""
    out = logits.clone()
    out[list(bias)] += torch.tensor(list(bias.values()), dtype=out.dtype)
    return out
