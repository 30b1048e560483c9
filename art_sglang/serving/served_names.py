"""The name a model's step is served under, `<model>@<step>`: built and read here only. Model names cannot
hold "@" (`model_store.name_problem`), so the last "@" separates the step."""

from __future__ import annotations

from collections.abc import Iterable

_SEPARATOR = "@"


def served_name(model: str, step: int) -> str:
    """The name requests use for `model`'s adapter of `step`."""
    return f"{model}{_SEPARATOR}{step}"


def served_prefix(model: str) -> str:
    """What every served name of `model` starts with."""
    return f"{model}{_SEPARATOR}"


def parse_served_name(name: str) -> tuple[str, int] | None:
    """(model, step) of a served name; None for another form."""
    model, separator, step = name.rpartition(_SEPARATOR)
    return (model, int(step)) if separator and step.isdigit() else None


def step_of(name: str) -> int:
    """The step of a served name, -1 for another form (sorts first)."""
    parsed = parse_served_name(name)
    return parsed[1] if parsed is not None else -1


def steps_of(model: str, names: Iterable[str]) -> set[int]:
    """The steps of `model` among served names."""
    parsed = (parse_served_name(name) for name in names)
    return {found[1] for found in parsed if found is not None and found[0] == model}
