"""Sampling constraints of a rollout (logit bias, an allowed-token set, a grammar): how a request states
them, the form they travel in to the trainer, and how the trainer reproduces them.

Why the trainer must know: a constrained token was sampled from the constrained distribution, and SGLang
reports its logprob under that distribution (its logits are biased and masked before the sampler takes
logprobs). A trainer that scores the token under the full vocabulary gets a lower logprob, so every
importance ratio of a constrained token is off from the first step. So:

- The gateway reads the constraint of each chat/text completion (`constraint_of`), refuses malformed ones
  with a 400 and SGLang's `custom_logit_processor` always (SGLang deserializes it with dill: arbitrary code
  in the server), and attaches the canonical form to each returned choice as `art_constraint`. OpenAI's
  client keeps that field on the Choice and `model_dump` keeps it, as it keeps SGLang's `token_ids`.
- `allowed_token_ids` (an action mask, sent in `extra_body`) is not an SGLang field (SGLang would ignore it
  and sample unconstrained), so the gateway forwards it as SGLang's `logit_bias`: +`MASK_BIAS` on each
  allowed id. Every other token then has at most e^(gap − 100) of an allowed token's probability (gap: how
  far its logit exceeds the allowed ones'), which is below float32's resolution for any real model; the
  trainer applies the exact mask.
- The trainer (`training/loss.py`) adds the bias and masks to the allowed set on the logits of each
  constrained sampled token before its log-softmax; a grammar is replayed over the sampled ids with
  xgrammar (grammars.py, optional). What it cannot reproduce (a grammar without xgrammar) is refused,
  naming it, unless the user trains with `train_unconstrained=True`.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import TrainingInputError

CONSTRAINT_FIELD = "art_constraint"  # on each returned choice
ALLOWED_FIELD = "allowed_token_ids"  # the request's action mask (extra_body)
MAX_BIAS = 100.0  # OpenAI's bounds of a logit_bias value
MASK_BIAS = 100.0  # what the gateway adds to each allowed id, in SGLang's logit_bias
GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema")
# A request states the first three; "structural_tag" is the grammar SGLang gives a tool_choice (tool_choice.py).
GrammarKind = Literal["regex", "ebnf", "json_schema", "structural_tag"]


def grammars_available() -> bool:
    """Whether xgrammar is installed, so grammars can be replayed (grammars.py) and sampled (reference)."""
    return importlib.util.find_spec("xgrammar") is not None


class ConstraintError(ValueError):
    """A malformed or refused constraint in a request; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Grammar(BaseModel):
    """A structured-output grammar as SGLang takes it: a regex, an EBNF grammar, a JSON schema or a legacy
    structural tag (JSON text)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GrammarKind
    source: str = Field(min_length=1)


class SamplingConstraint(BaseModel):
    """What a choice was sampled under: `logit_bias` (token id → bias added to its logit), the
    `allowed_token_ids` (every other token masked), a `grammar`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    grammar: Grammar | None = None

    def describe(self) -> str:
        parts = []
        if self.logit_bias:
            parts.append(f"logit_bias on {len(self.logit_bias)} tokens")
        if self.allowed_token_ids is not None:
            parts.append(f"{ALLOWED_FIELD} ({len(self.allowed_token_ids)} tokens)")
        if self.grammar is not None:
            parts.append(f"a {self.grammar.kind} grammar")
        return ", ".join(parts) or "no constraint"

    def without_grammar(self) -> SamplingConstraint | None:
        """The part the trainer reproduces; None if nothing is left."""
        if self.grammar is None:
            return self
        rest = self.model_copy(update={"grammar": None})
        return rest if rest.logit_bias or rest.allowed_token_ids is not None else None

    def allows(self, token: int) -> bool:
        return self.allowed_token_ids is None or token in self.allowed_token_ids

    def forwarded_bias(self) -> dict[str, float]:
        """SGLang's `logit_bias` that samples under this constraint (grammars travel in their own field)."""
        bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            return {str(t): MASK_BIAS + bias.get(t, 0.0) for t in self.allowed_token_ids}
        return {str(t): value for t, value in bias.items()}


def constraint_of(payload: Mapping[str, Any]) -> SamplingConstraint | None:
    """The constraint a chat/text completion request states (None: unconstrained); `ConstraintError`
    for a malformed one or a custom logit processor."""
    if payload.get("custom_logit_processor") is not None:
        raise ConstraintError(
            "custom_logit_processor is refused: SGLang deserializes it with dill, which runs arbitrary Python "
            "code in the inference server, and the trainer could not reproduce its effect on the logprobs. "
            f"Use logit_bias, {ALLOWED_FIELD} or a regex/ebnf/json_schema grammar.",
            "custom_logit_processor",
        )
    if payload.get("structural_tag") is not None:
        raise ConstraintError(
            "structural_tag is not supported: the trainer could not reproduce its constraint on the logprobs",
            "structural_tag",
        )
    bias = _logit_bias(payload.get("logit_bias"))
    allowed = _allowed(payload.get(ALLOWED_FIELD))
    if allowed is not None:
        outside = sorted(set(bias) - set(allowed))
        if outside:
            raise ConstraintError(
                f"logit_bias names token {outside[0]}, which is not in {ALLOWED_FIELD}: a token outside the "
                "allowed set is never sampled, so its bias would mean nothing",
                "logit_bias",
            )
    grammar = _grammar(payload)
    if not bias and allowed is None and grammar is None:
        return None
    return SamplingConstraint(
        logit_bias=tuple(sorted(bias.items())), allowed_token_ids=allowed, grammar=grammar
    )


def _token_id(value: Any, where: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConstraintError(f"{where} takes token ids (non-negative integers), got {value!r}", where)
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConstraintError("logit_bias must be an object mapping token ids to biases", "logit_bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        token = _token_id(key, "logit_bias")
        if (
            isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not -MAX_BIAS <= number <= MAX_BIAS
        ):
            raise ConstraintError(
                f"logit_bias of token {key} must be a number from -100 to 100, got {number!r}", "logit_bias"
            )
        bias[token] = float(number)
    return bias


def _allowed(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConstraintError(f"{ALLOWED_FIELD} must be a non-empty list of token ids", ALLOWED_FIELD)
    return tuple(sorted({_token_id(item, ALLOWED_FIELD) for item in value}))


def _grammar(payload: Mapping[str, Any]) -> Grammar | None:
    """SGLang's regex/ebnf/json_schema fields and OpenAI's response_format, at most one of them."""
    found: list[Grammar] = []
    for kind in GRAMMAR_FIELDS:
        source = payload.get(kind)
        if source is None:
            continue
        if not isinstance(source, str) or not source:
            raise ConstraintError(f"{kind} must be a non-empty string (as SGLang takes it)", kind)
        found.append(Grammar(kind=kind, source=source))
    response_format = payload.get("response_format")
    if response_format is not None:
        schema = _response_format_schema(response_format)
        if schema is not None:
            found.append(Grammar(kind="json_schema", source=schema))
    if len(found) > 1:
        raise ConstraintError(
            "only one of regex, ebnf, json_schema and a JSON response_format may be given",
            found[1].kind,
        )
    if found and found[0].kind == "json_schema":
        _check_schema(found[0].source)
    return found[0] if found else None


def _response_format_schema(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConstraintError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
            )
        try:
            return json.dumps(schema)
        except RecursionError:
            raise ConstraintError(_TOO_DEEP, "response_format") from None
    raise ConstraintError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


_TOO_DEEP = "the JSON schema is nested too deeply to be compiled into a grammar"


def _check_schema(source: str) -> None:
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise ConstraintError(f"json_schema is not valid JSON: {exc}", "json_schema") from exc
    except RecursionError:
        raise ConstraintError(_TOO_DEEP, "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("json_schema must be a JSON schema (an object)", "json_schema")


def carried(choice: Mapping[str, Any], where: str) -> SamplingConstraint | None:
    """The constraint a trajectory's choice carries (`art_constraint`), or None."""
    value = choice.get(CONSTRAINT_FIELD)
    if value is None:
        return None
    try:
        return SamplingConstraint.model_validate(value)
    except ValidationError as exc:
        raise TrainingInputError(f"{where}: {CONSTRAINT_FIELD} is malformed: {exc}") from exc
