"""`Trajectory` and `TrajectoryGroup`, with the fields and construction rules of OpenPipe ART 0.5.x."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Iterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, cast

from pydantic import BaseModel, Field

from .errors import TrainingInputError
from .gather_context import current_gather_context
from .types import Choice, Message, Messages, MessagesAndChoices, Tools

MetadataValue = float | int | str | bool | None
MetricValue = float | int | bool


def get_messages(messages_and_choices: MessagesAndChoices) -> Messages:
    """The conversation as plain chat messages: each Choice becomes an assistant message."""
    messages: Messages = []
    for item in messages_and_choices:
        if isinstance(item, Choice):
            message: dict[str, Any] = {"role": "assistant", "content": item.message.content or ""}
            if item.message.tool_calls:
                message["tool_calls"] = [call.model_dump(mode="json") for call in item.message.tool_calls]
        else:
            # Chat templates expect a string where the API allows None.
            message = {**item, "content": item.get("content") or ""}
        messages.append(cast(Message, message))
    return messages


class History(BaseModel):
    """A further conversation of the same rollout (e.g. a sub-agent), trained like the main one."""

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)


class Trajectory(BaseModel):
    """One rollout: the conversation (prompt messages and sampled Choices), its reward and what was logged."""

    messages_and_choices: MessagesAndChoices = Field(default_factory=list)
    tools: Tools | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: datetime = Field(default_factory=datetime.now, exclude=True)

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record the rollout's wall time as the `duration` metric; returns self for `return t.finish()`."""
        self.metrics["duration"] = (datetime.now() - self.start_time).total_seconds()
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Add the time spent inside the block to the metric `<metric_name>_duration`."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - start

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"


class PydanticException(BaseModel):
    """An exception raised by a rollout, kept in serializable form."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> PydanticException:
        return cls(
            type=str(type(exc)),
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )


class TrajectoryGroup(BaseModel):
    """Trajectories of the same task, compared with each other to compute advantages.

    Built from trajectories and exceptions, it is a group at once. Built from awaitables (coroutines of
    rollouts) it is an awaitable that runs them concurrently and yields the group; a rollout that raises
    is recorded in `exceptions` (inside `gather_trajectory_groups`, up to its `max_exceptions`).
    """

    trajectories: list[Trajectory]
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    # Construction lives in __new__ because, as in ART, it may return an awaitable instead of a group.
    # Pydantic calls the constructor with the dumped fields when validating (this class has its own
    # __init__), so dicts are accepted too: that is what makes `model_validate`/JSON round trips work.
    def __new__(
        cls,
        trajectories: Iterable[Trajectory | BaseException | dict[str, Any]]
        | Iterable[Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[BaseException | PydanticException | dict[str, Any]] = (),
        metadata: dict[str, MetadataValue] | None = None,
        metrics: dict[str, MetricValue] | None = None,
        logs: list[str] | None = None,
    ) -> Any:
        items = list(trajectories)
        extras = {"metadata": metadata or {}, "metrics": metrics or {}, "logs": logs or []}
        awaitables = [_is_awaitable(item) for item in items]
        if any(awaitables):
            if not all(awaitables):
                raise TypeError(
                    "TrajectoryGroup takes either awaitables of Trajectory or finished ones, not both"
                )
            return PendingTrajectoryGroup(cast(list[Awaitable[Trajectory]], items), list(exceptions), extras)
        unknown = [i for i in items if not isinstance(i, (Trajectory, BaseException, dict))]
        if unknown:
            raise TypeError(
                "TrajectoryGroup takes Trajectory objects, exceptions or awaitables of Trajectory; "
                f"got {type(unknown[0]).__name__}"
            )
        failures = [*(i for i in items if isinstance(i, BaseException)), *exceptions]
        group = super().__new__(cls)
        BaseModel.__init__(
            group,
            trajectories=[i for i in items if not isinstance(i, BaseException)],
            exceptions=[
                PydanticException.from_exception(e) if isinstance(e, BaseException) else e for e in failures
            ],
            **extras,
        )
        return group

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """All work is done in __new__ (Python calls __init__ after it with the same arguments)."""

    def log(self, message: str) -> None:
        self.logs.append(message)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


def _is_awaitable(item: object) -> bool:
    return hasattr(item, "__await__")


class PendingTrajectoryGroup:
    """What `TrajectoryGroup(<awaitables>)` returns: await it for the group. `size` is the rollout count,
    which `gather_trajectory_groups` uses as its progress total."""

    def __init__(
        self, rollouts: list[Awaitable[Trajectory]], exceptions: list[BaseException], extras: dict[str, Any]
    ) -> None:
        self.size = len(rollouts)
        self._rollouts = rollouts
        self._exceptions = exceptions
        self._extras = extras

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self._run().__await__()

    async def _run(self) -> TrajectoryGroup:
        context = current_gather_context()
        trajectories: list[Trajectory] = []
        exceptions = list(self._exceptions)
        tasks = [asyncio.ensure_future(r) for r in self._rollouts]
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    trajectory = await next_done
                except Exception as exc:
                    if context.count_exception():
                        raise
                    exceptions.append(exc)
                    continue
                trajectories.append(trajectory)
                context.record_trajectories([trajectory])
        finally:
            # Too many exceptions re-raise above; the sibling rollouts must not keep running unobserved.
            for task in tasks:
                task.cancel()
        return TrajectoryGroup(trajectories, exceptions=exceptions, **self._extras)


def coerce_groups(groups: Iterable[Any]) -> list[TrajectoryGroup]:
    """Our TrajectoryGroups; ART's (openpipe-art) are converted through their JSON form."""
    if groups is None or isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise TrainingInputError(
            f"train() takes a list of trajectory groups, got {type(groups).__name__}: pass what "
            "gather_trajectory_groups(...) returned"
        )
    result = []
    for index, group in enumerate(groups):
        if isinstance(group, TrajectoryGroup):
            result.append(group)
        elif hasattr(group, "model_dump") and hasattr(group, "trajectories"):
            result.append(TrajectoryGroup.model_validate(group.model_dump()))
        else:
            raise TrainingInputError(
                f"group {index} is a {type(group).__name__}, not a TrajectoryGroup: build groups with "
                "art.TrajectoryGroup(...) or gather_trajectory_groups(...)"
            )
    if not result:
        raise TrainingInputError("train() got no trajectory groups: gather at least one group")
    return result


def coerce_trajectory(trajectory: Any, index: int) -> Trajectory:
    """Our Trajectory; ART's are converted through their JSON form."""
    if isinstance(trajectory, Trajectory):
        return trajectory
    if hasattr(trajectory, "model_dump") and hasattr(trajectory, "messages_and_choices"):
        return Trajectory.model_validate(trajectory.model_dump())
    raise TrainingInputError(
        f"SFT item {index} is a {type(trajectory).__name__}, not a Trajectory: build them with art.Trajectory(...)"
    )
