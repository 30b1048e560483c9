"""Trajectory, TrajectoryGroup and gather_trajectory_groups: construction, serialization, concurrency,
progress and exception limits."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from art_sglang import History, Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_sglang.types import Choice


def sampled_choice(text: str = "4", *, tool_call: bool = False) -> Choice:
    message: dict = {"role": "assistant", "content": text}
    if tool_call:
        message["tool_calls"] = [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
        ]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls" if tool_call else "stop",
            "message": message,
            "logprobs": {
                "content": [
                    {
                        "token": text,
                        "logprob": -0.25,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": text, "logprob": -0.25, "bytes": list(text.encode())}],
                    }
                ]
            },
        }
    )


def conversation(reward: float = 1.0) -> Trajectory:
    return Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "2+2?"},
            sampled_choice(tool_call=True),
            {"role": "tool", "tool_call_id": "call_1", "content": None},
            sampled_choice("4"),
        ],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        reward=reward,
        metrics={"turns": 2, "solved": True},
        metadata={"scenario": "add", "seed": 3},
        additional_histories=[
            History(messages_and_choices=[{"role": "user", "content": "sub"}, sampled_choice("5")])
        ],
    )


def test_trajectory_messages_turn_choices_into_assistant_messages():
    messages = conversation().messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert messages[3]["content"] == ""  # None content becomes "" for chat templates
    assert messages[4] == {"role": "assistant", "content": "4"}


async def test_trajectory_log_finish_and_track_duration():
    trajectory = Trajectory()
    trajectory.log("started")
    async with trajectory.track_duration("tool"):
        await asyncio.sleep(0.05)
    async with trajectory.track_duration("tool"):
        await asyncio.sleep(0.05)
    assert trajectory.finish() is trajectory
    assert trajectory.logs == ["started"]
    assert 0.1 <= trajectory.metrics["tool_duration"] < 1.0
    assert trajectory.metrics["duration"] >= trajectory.metrics["tool_duration"]
    assert "start_time" not in trajectory.model_dump()


def test_group_from_trajectories_and_exceptions():
    def failing() -> None:
        raise ValueError("rollout broke")

    try:
        failing()
    except ValueError as exc:
        caught = exc
    group = TrajectoryGroup(
        (t for t in [conversation(1.0), caught, conversation(0.0)]),  # a generator is consumed once
        exceptions=[RuntimeError("timeout")],
        metadata={"task": "add"},
    )
    assert [t.reward for t in group] == [1.0, 0.0] and len(group) == 2
    assert [e.message for e in group.exceptions] == ["rollout broke", "timeout"]
    assert group.exceptions[0].type == str(ValueError)
    assert "in failing" in group.exceptions[0].traceback
    assert group.metadata == {"task": "add"}
    group.log("note")
    assert group.logs == ["note"]


async def test_group_rejects_other_items():
    with pytest.raises(TypeError, match="got str"):
        TrajectoryGroup([conversation(), "not a trajectory"])
    pending = rollout(1)
    with pytest.raises(TypeError, match="not both"):
        TrajectoryGroup([conversation(), pending])
    await pending


def test_json_round_trip_keeps_choices_and_logprobs():
    group = TrajectoryGroup([conversation(0.5), ValueError("x")], metrics={"group_size": 2})
    for restored in (
        TrajectoryGroup.model_validate(group.model_dump(mode="json")),
        TrajectoryGroup.model_validate_json(group.model_dump_json()),
    ):
        assert restored.model_dump() == group.model_dump()
        items = restored.trajectories[0].messages_and_choices
        assert [type(i).__name__ for i in items] == ["dict", "dict", "Choice", "dict", "Choice"]
        assert items[4].logprobs.content[0].logprob == -0.25
        assert items[4].logprobs.content[0].top_logprobs[0].token == "4"
        assert items[2].message.tool_calls[0].function.name == "add"
        assert restored.trajectories[0].metrics == {"turns": 2, "solved": True}
        assert restored.exceptions[0].message == "x"
        history = restored.trajectories[0].additional_histories[0]
        assert history.messages() == [
            {"role": "user", "content": "sub"},
            {"role": "assistant", "content": "5"},
        ]
        assert isinstance(history.messages_and_choices[1], Choice)


def test_group_copies_are_independent():
    group = TrajectoryGroup([conversation()], logs=["a"])
    for duplicate in (copy.copy(group), copy.deepcopy(group), group.model_copy(deep=True)):
        assert duplicate.model_dump() == group.model_dump()
    deep = copy.deepcopy(group)
    deep.trajectories[0].reward = -1.0
    deep.logs.append("b")
    assert group.trajectories[0].reward == 1.0 and group.logs == ["a"]


async def rollout(reward: float, delay: float = 0.2, fail: bool = False) -> Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise RuntimeError(f"rollout {reward} failed")
    return Trajectory(reward=reward, metrics={"length": 10 * reward}).finish()


async def test_group_of_awaitables_runs_them_concurrently():
    pending = TrajectoryGroup([rollout(r) for r in range(5)], metadata={"k": 1})
    assert not isinstance(pending, TrajectoryGroup)
    start = time.monotonic()
    group = await pending
    assert time.monotonic() - start < 0.8  # five 0.2 s rollouts: 1 s one after another
    assert isinstance(group, TrajectoryGroup)
    assert sorted(t.reward for t in group) == [0, 1, 2, 3, 4]
    assert group.metadata == {"k": 1}


async def test_group_of_awaitables_outside_gather_raises_the_first_failure():
    with pytest.raises(RuntimeError, match="rollout 1 failed"):
        await TrajectoryGroup([rollout(0), rollout(1, fail=True)])


async def test_gather_concurrent_ordered_with_progress(capsys):
    start = time.monotonic()
    groups = await gather_trajectory_groups(
        TrajectoryGroup(rollout(g + r / 10) for r in range(4)) for g in range(3)
    )
    assert time.monotonic() - start < 1.5  # 12 rollouts of 0.2 s: 2.4 s one after another
    assert [sorted(round(t.reward, 1) for t in g) for g in groups] == [
        [0.0, 0.1, 0.2, 0.3],
        [1.0, 1.1, 1.2, 1.3],
        [2.0, 2.1, 2.2, 2.3],
    ]
    bar = capsys.readouterr().err
    assert "gather" in bar and "12/12" in bar
    assert "reward=1.15" in bar  # the running mean over all 12 rollouts


async def test_gather_keeps_failures_within_the_limit(capsys):
    groups = await gather_trajectory_groups(
        [
            TrajectoryGroup([rollout(1), rollout(2, fail=True)]),
            TrajectoryGroup([rollout(3), rollout(4, fail=True)]),
        ],
        max_exceptions=2,
        pbar_desc="val",
    )
    assert [[t.reward for t in g] for g in groups] == [[1], [3]]
    assert [[e.message for e in g.exceptions] for g in groups] == [["rollout 2 failed"], ["rollout 4 failed"]]
    bar = capsys.readouterr().err
    assert "4/4" in bar and "exceptions=2" in bar


async def test_gather_raises_above_the_limit_and_cancels_the_rest():
    cancelled = asyncio.Event()

    async def slow() -> Trajectory:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Trajectory()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed"):
        await gather_trajectory_groups(
            [
                TrajectoryGroup([rollout(1, 0.05, fail=True), rollout(2, 0.1, fail=True)]),
                TrajectoryGroup([slow(), rollout(3)]),
            ],
            max_exceptions=1,
        )
    assert time.monotonic() - start < 5
    assert cancelled.is_set()


async def test_gather_share_of_failures():
    def batch(failures: int) -> list:
        return [TrajectoryGroup([rollout(i, 0.01, fail=i < failures) for i in range(8)])]

    [group] = await gather_trajectory_groups(batch(2), max_exceptions=0.25)
    assert len(group) == 6 and len(group.exceptions) == 2
    with pytest.raises(RuntimeError):
        await gather_trajectory_groups(batch(3), max_exceptions=0.25)


async def test_gather_plain_group_awaitables_and_after_each():
    async def whole_group(reward: float, fail: bool = False) -> TrajectoryGroup:
        await asyncio.sleep(0.01)
        if fail:
            raise RuntimeError("group failed")
        return TrajectoryGroup([Trajectory(reward=reward)])

    async def after_each(group: TrajectoryGroup):
        reward = group.trajectories[0].reward
        if reward == 0:
            return None  # dropped
        if reward == 2:
            return [group, group]  # expanded
        return group

    groups = await gather_trajectory_groups(
        [whole_group(0), whole_group(1), whole_group(9, fail=True), whole_group(2)],
        max_exceptions=1,
        after_each=after_each,
    )
    assert [g.trajectories[0].reward for g in groups] == [1, 2, 2]
