"""Checks on trajectory groups that need no tokenizer, run once per train() in the parent before anything
is sent to the trainer (`check_groups`; the worker trains on what passed). Groups travel as plain dicts (`groups_to_wire`): a dict with "role"
is a chat message (context), a dict with "message" and "finish_reason" is a sampled Choice (trained).

A Choice that carries the ids the server sampled (`token_ids`, asked for with `return_token_ids`; the
gateway asks for them) is trained on exactly those ids: its logprob entries must number len(token_ids), or
one more for the stop token; its text is not checked. Otherwise a Choice's `logprobs.content` must spell
out exactly its `message.content` (the entries' bytes, joined), optionally followed by one trailing entry
for the stop token. Entries that spell anything else (one too
few, one too many, another completion's) are "logprobs of the wrong length" and an error. The check is
skipped where the text cannot be compared (tool calls or `reasoning_content` split off, tokens holding
part of a character): there only the number of entries is compared later, by the tokenizer (see
`tokenize.py`).
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..constraints import ALLOWED_FIELD, carried, grammars_available
from ..errors import TrainingInputError
from ..tool_choice import TEMPLATE_TOOLS_FIELD

if TYPE_CHECKING:
    from ..trajectories import TrajectoryGroup

WireGroup = dict[str, Any]

# A plausible sampler logprob: a real sampled token is never below this (float32 probabilities end near
# e^-104, so such a token cannot be drawn), while -9999 and similar stand-ins for -inf are caught; above
# 0 only by rounding.
MIN_LOGPROB = -1000.0
MAX_LOGPROB = 1e-3
_PACKED = "packed_float64"  # for_trainer's form of a choice's logprob values


def groups_to_wire(groups: Sequence[TrajectoryGroup | WireGroup]) -> list[WireGroup]:
    """Plain-dict form of the groups, as sent to the worker. Python mode keeps NaN/inf rewards as floats
    (JSON mode would turn them into null) so validation can name them."""
    return [g if isinstance(g, dict) else g.model_dump(mode="python") for g in groups]


@dataclass(frozen=True)
class CheckedGroups:
    """Trajectory groups in wire form that `validate_groups` passed: converted and checked once."""

    wire: list[WireGroup]


def check_groups(groups: Sequence[TrajectoryGroup | WireGroup], **rules: bool) -> CheckedGroups:
    """The groups' wire form, checked (`rules`: `validate_groups`' keywords, `TrainOptions.input_rules`)."""
    wire = groups_to_wire(groups)
    validate_groups(wire, **rules)
    return CheckedGroups(wire)


def for_trainer(groups: Sequence[WireGroup]) -> list[WireGroup]:
    """The wire groups less what the trainer never reads, as the worker is sent them: a step's request is
    mostly logprob entries, and the worker parses it on every step. An entry keeps its value, and its
    token and bytes only where they are checked against the text (a Choice without its sampled ids);
    `top_logprobs` go."""
    return [
        {**group, "trajectories": [_trajectory_for_trainer(t) for t in group.get("trajectories") or []]}
        for group in groups
    ]


def _trajectory_for_trainer(trajectory: WireGroup) -> WireGroup:
    def items(history: WireGroup) -> list[Any]:
        return [
            _choice_for_trainer(i) if is_choice(i) else i for i in history.get("messages_and_choices") or []
        ]

    slim = {**trajectory, "messages_and_choices": items(trajectory)}
    if trajectory.get("additional_histories"):
        slim["additional_histories"] = [
            {**history, "messages_and_choices": items(history)}
            for history in trajectory["additional_histories"]
        ]
    return slim


def _choice_for_trainer(choice: WireGroup) -> WireGroup:
    entries = logprob_entries(choice)
    if entries is None:
        return choice
    if sampled_ids(choice) is not None:
        # The values only, as float64 bytes: writing and parsing ~50k JSON floats (48 rollouts of 1k
        # tokens) took longer than the rest of the request (the worker runs on this host: native order).
        values = array("d", (float(e["logprob"]) for e in entries))
        return {**choice, "logprobs": {_PACKED: base64.b64encode(values.tobytes()).decode()}}
    keep = ("token", "bytes", "logprob")
    return {**choice, "logprobs": {"content": [{k: e[k] for k in keep if k in e} for e in entries]}}


def is_choice(item: Any) -> bool:
    return isinstance(item, dict) and "message" in item and "finish_reason" in item


def histories(trajectory: WireGroup) -> list[tuple[list[Any], list[Any] | None]]:
    """(messages_and_choices, tools) of the main conversation and of each additional history."""
    main = (trajectory.get("messages_and_choices") or [], trajectory.get("tools"))
    extra = [
        (h.get("messages_and_choices") or [], h.get("tools"))
        for h in trajectory.get("additional_histories") or []
    ]
    return [main, *extra]


def prompt_tools(items: list[Any], tools: list[Any] | None) -> list[list[Any] | None]:
    """The distinct tool sets a history's Choices were prompted with (None: no tools): a Choice's
    `art_template_tools` where the gateway attached them (SGLang's template showed other tools than the
    request's: a named tool_choice only that tool, "none" none), else the history's `tools`."""
    found: list[list[Any] | None] = []
    for item in items:
        if is_choice(item):
            shown = item.get(TEMPLATE_TOOLS_FIELD)
            shown = (tools if shown is None else shown) or None
            if shown not in found:
                found.append(shown)
    return found


def sampled_ids(choice: WireGroup) -> list[int] | None:
    """The completion token ids the server sampled for this choice (`token_ids`), or None when the
    server did not return them."""
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else None


def logprob_entries(choice: WireGroup) -> list[dict[str, Any]] | None:
    """The per-token logprob entries of a choice, or None when the rollout did not ask for logprobs."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if _PACKED in logprobs:  # as for_trainer sends them
        values = array("d")
        values.frombytes(base64.b64decode(logprobs[_PACKED]))
        return [{"logprob": value} for value in values]
    entries = logprobs.get("content")
    if entries is None:
        entries = logprobs.get("refusal")
    return list(entries) if entries is not None else None


def _entry_bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    return bytes(raw) if raw is not None else str(entry.get("token", "")).encode()


_REPLACEMENT = "\ufffd".encode()


def text_checkable(choice: WireGroup) -> bool:
    """Whether the logprob entries can be compared with `message.content`: no tool calls or reasoning
    split off, and no entry that is only part of a character (servers report such a token as U+FFFD,
    not as its bytes, so its text cannot be joined back; nor can a content holding U+FFFD be matched
    against them, as the decoder writes one U+FFFD per invalid run of bytes, not one per token)."""
    message = choice.get("message") or {}
    if message.get("tool_calls") or message.get("reasoning_content"):
        return False
    return not any(_REPLACEMENT in _entry_bytes(e) for e in logprob_entries(choice) or [])


def content_entry_count(choice: WireGroup, entries: list[dict[str, Any]]) -> int | None:
    """How many leading entries spell the choice's content: all of them, or all but a trailing stop
    token. None when they spell something else."""
    target = ((choice.get("message") or {}).get("content") or "").encode()
    joined = b"".join(_entry_bytes(e) for e in entries)
    if joined == target:
        return len(entries)
    if entries and joined[: len(joined) - len(_entry_bytes(entries[-1]))] == target:
        return len(entries) - 1
    return None


def validate_groups(
    groups: list[WireGroup], *, allow_training_without_logprobs: bool, train_unconstrained: bool = False
) -> None:
    """Raise TrainingInputError, naming the group and trajectory index, for input that cannot be trained:
    no groups, an empty group, a reward that is not a finite number, no sampled Choice in any trajectory,
    a Choice without logprobs (unless allowed), implausible logprobs, logprobs that do not match the
    Choice's text, a sampling constraint the trainer cannot reproduce (unless `train_unconstrained`). A
    trajectory without a Choice is context (its reward counts in its group's mean)."""
    if not groups:
        raise TrainingInputError("no trajectory groups to train on")
    choices = 0
    for gi, group in enumerate(groups):
        trajectories = group.get("trajectories") or []
        if not trajectories:
            failed = len(group.get("exceptions") or [])
            hint = f" ({failed} rollouts raised exceptions)" if failed else ""
            raise TrainingInputError(f"group {gi} has no trajectories{hint}")
        for ti, trajectory in enumerate(trajectories):
            choices += _validate_trajectory(
                trajectory,
                f"group {gi}, trajectory {ti}",
                allow_training_without_logprobs,
                train_unconstrained,
            )
    if not choices:
        raise TrainingInputError(
            "no trajectory of any group has an assistant Choice to train on (plain assistant message "
            "dicts are context; append the Choice objects returned by the chat completion)"
        )


def _validate_trajectory(
    trajectory: WireGroup, where: str, allow_without_logprobs: bool, train_unconstrained: bool
) -> int:
    """Checks one trajectory; returns its number of Choices."""
    reward = trajectory.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TrainingInputError(f"{where}: reward must be a finite number, got {reward!r}")
    for hi, (items, tools) in enumerate(histories(trajectory)):
        _validate_prompt_tools(
            items, tools, where if hi == 0 else f"{where}, history {hi}", train_unconstrained
        )
    choices = [item for items, _ in histories(trajectory) for item in items if is_choice(item)]
    for ci, choice in enumerate(choices):
        _validate_choice(choice, f"{where}, choice {ci}", allow_without_logprobs)
        _validate_constraint(choice, f"{where}, choice {ci}", train_unconstrained)
    return len(choices)


def _validate_choice(choice: WireGroup, where: str, allow_without_logprobs: bool) -> None:
    ids = sampled_ids(choice)
    if ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TrainingInputError(f"{where}: token_ids must be a list of token ids, got {ids!r}")
    entries = logprob_entries(choice)
    if entries is None:
        if not allow_without_logprobs:
            raise TrainingInputError(
                f"{where}: the Choice has no logprobs; request them (logprobs=True) in the rollout or "
                "train with allow_training_without_logprobs=True"
            )
        return
    for ei, entry in enumerate(entries):
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TrainingInputError(f"{where}: logprob {ei} must be a finite number, got {value!r}")
        if not MIN_LOGPROB <= value <= MAX_LOGPROB:
            raise TrainingInputError(
                f"{where}: logprob {ei} is {value!r}, not a sampled token's logprob (expected "
                f"{MIN_LOGPROB:g} to 0; values like -9999 stand in for -inf and would poison the step)"
            )
    if ids is not None:
        if len(entries) not in (len(ids), len(ids) + 1):
            raise TrainingInputError(
                f"{where}: logprobs of the wrong length: {len(entries)} logprob entries for "
                f"{len(ids)} sampled token_ids (expected {len(ids)}, or one more for the stop token)"
            )
    elif text_checkable(choice) and content_entry_count(choice, entries) is None:
        content = (choice.get("message") or {}).get("content") or ""
        raise TrainingInputError(
            f"{where}: logprobs of the wrong length: {len(entries)} logprob entries do not spell the "
            f"choice's content ({len(content)} characters); {_first_difference(content.encode(), entries)}"
        )


def _first_difference(content: bytes, entries: list[dict[str, Any]]) -> str:
    """Where the entries' text leaves the content, with a little of each from there: what tells a
    server that left tokens out of the text (special tokens) from one that answered something else."""
    joined = b"".join(_entry_bytes(e) for e in entries)
    at = next((i for i, (a, b) in enumerate(zip(content, joined, strict=False)) if a != b), None)
    at = min(len(content), len(joined)) if at is None else at
    show = 24
    return (
        f"they differ from byte {at}: the content has {content[at : at + show]!r}, the entries "
        f"{joined[at : at + show]!r}"
    )


def _validate_prompt_tools(
    items: list[Any], tools: list[Any] | None, where: str, train_unconstrained: bool
) -> None:
    """A conversation is rendered once with one set of tools, so its Choices must all have been prompted
    with the same (unless `train_unconstrained`: then it is rendered with its `tools`)."""
    for item in items:
        shown = item.get(TEMPLATE_TOOLS_FIELD) if is_choice(item) else None
        if shown is not None and not isinstance(shown, list):
            raise TrainingInputError(
                f"{where}: {TEMPLATE_TOOLS_FIELD} must be a list of tools, got {shown!r}"
            )
    found = prompt_tools(items, tools)
    if len(found) > 1 and not train_unconstrained:
        sets = "; ".join(_tool_set(shown) for shown in found)
        raise TrainingInputError(
            f"{where}: its Choices were sampled with different tools in their prompts ({sets}; a named "
            'tool_choice shows only that tool, "none" none), so one rendering of the conversation cannot '
            "reproduce every prompt the sampled tokens were scored under. Keep one tool_choice per trajectory "
            "(or split it into trajectories), or pass train_unconstrained=True to render it with its tools."
        )


def _tool_set(tools: list[Any] | None) -> str:
    if not tools:
        return "no tools"
    names = [str((t.get("function") or {}).get("name")) if isinstance(t, dict) else "?" for t in tools]
    return "tools " + ", ".join(names)


def _validate_constraint(choice: WireGroup, where: str, train_unconstrained: bool) -> None:
    """A constrained Choice is trained under its constraint: on the ids it was sampled as (a
    re-tokenization could hold ids the constraint never allowed), within the allowed set, and a grammar
    only with xgrammar to replay it. Otherwise refused, unless `train_unconstrained`."""
    constraint = carried(choice, where)
    if constraint is None:
        return
    ids = sampled_ids(choice)
    problem = None
    if constraint.grammar is not None and not grammars_available():
        problem = (
            f"it was sampled under a {constraint.grammar.kind} grammar, which this trainer replays only with "
            "xgrammar (pip install -e '.[grammars]' in the art_sglang checkout, where train() runs); without it its logprobs would "
            "be computed without the grammar's mask"
        )
    elif ids is None:
        problem = (
            "it has no token_ids (SGLang's router in front of several replicas drops them), so the tokens "
            "its constraint applied to are not known"
        )
    if problem is not None and not train_unconstrained:
        raise TrainingInputError(
            f"{where}: a constrained Choice ({constraint.describe()}) cannot be trained as sampled: {problem}. "
            "Pass train_unconstrained=True to train it without its constraint."
        )
    allowed = set(constraint.allowed_token_ids) if constraint.allowed_token_ids is not None else None
    outside = next((i for i in ids or () if allowed is not None and i not in allowed), None)
    if outside is not None:
        raise TrainingInputError(
            f"{where}: token {outside} of its token_ids is not in the {ALLOWED_FIELD} it was sampled with"
        )
