"""SGLang's `n` — how many choices a request asks for per prompt — read as the server reads it.

The gateway refuses `n > 1` on an adapter (SGLang 0.5.17 then never lets the adapter go), so it must read
`n` exactly as the server does: a rule that sees only a JSON integer lets `2.0` and `"2"` through, which the
server's schema coerces to 2. One reading serves both the gateway's rules and the reference engine:

- the OpenAI routes: the top-level `n`, an integer of at least 1 as pydantic's lax mode reads it (SGLang's
  request schema is pydantic): `2.0` and `"2"` are 2, `2.5`, `null` and `"two"` are refused;
- `/generate`: `sampling_params.n`, where `sampling_params` is one dict or a list of dicts (one per prompt
  of a batch), whose `n` must then agree. SGLang takes this `n` raw, with no schema: it compares it with 1
  and multiplies its prompt lists by it, so only an integer serves. SGLang 0.5.17 fails a request whose `n`
  is `2.0` or `"2"` with a TypeError and drops the connection (H100, 2026-11-27): it is refused here, a
  400 that says why, and the reference engine refuses it the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

GENERATE_PATH = "/generate"

# `n` on SGLang's OpenAI request schema: the reference engine's request models declare it with this type.
ChoiceCount = Annotated[int, Field(ge=1)]
_COUNT: TypeAdapter[int] = TypeAdapter(ChoiceCount)
# `n` in /generate's sampling_params: a JSON integer (strict: no float, string or boolean) of at least 1.
_RAW_COUNT: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(ge=1, strict=True)])


class ChoiceCountError(ValueError):
    """A request's `n` the server refuses; `field` names where it is."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def choice_count(value: Any, field: str = "n", reader: TypeAdapter[int] = _COUNT) -> int:
    """One `n` as the server reads it (its schema's lax reading unless `reader` says otherwise);
    `ChoiceCountError` for one it refuses."""
    try:
        return reader.validate_python(value)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise ChoiceCountError(f"{field}={value!r} is refused: {reason}", field) from None


def generate_choice_count(sampling_params: Any) -> int:
    """`n` of a /generate request from its `sampling_params` (absent: 1; one dict; or a list of dicts, one
    per prompt, whose `n` must be the same)."""
    if sampling_params is None:
        return 1
    if isinstance(sampling_params, Mapping):
        return choice_count(sampling_params.get("n", 1), "sampling_params.n", _RAW_COUNT)
    if not isinstance(sampling_params, list) or not all(isinstance(p, Mapping) for p in sampling_params):
        raise ChoiceCountError("sampling_params must be a dict or a list of dicts", "sampling_params")
    counts = {
        choice_count(p.get("n", 1), f"sampling_params[{i}].n", _RAW_COUNT)
        for i, p in enumerate(sampling_params)
    }
    if len(counts) > 1:
        # SGLang's own words for it.
        raise ChoiceCountError(
            "The parallel_sample_num should be the same for all samples in sample params.", "sampling_params"
        )
    return counts.pop() if counts else 1


def choices_per_prompt(path: str, payload: Mapping[str, Any]) -> int:
    """How many choices per prompt a request to `path` (normalized) asks for."""
    if path == GENERATE_PATH:
        return generate_choice_count(payload.get("sampling_params"))
    return choice_count(payload.get("n", 1))
