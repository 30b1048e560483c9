"""`<model>@<step>` is built and read by one owner."""

from __future__ import annotations

from art_sglang.serving.served_names import (
    parse_served_name,
    served_name,
    served_prefix,
    step_of,
    steps_of,
)


def test_a_served_name_reads_back_as_its_model_and_step() -> None:
    assert served_name("agent", 12) == "agent@12"
    assert served_name("agent", 3).startswith(served_prefix("agent"))
    assert parse_served_name(served_name("agent", 12)) == ("agent", 12)
    assert parse_served_name("agent") is None and parse_served_name("agent@latest") is None
    assert sorted(["a@10", "base", "a@9"], key=step_of) == ["base", "a@9", "a@10"]
    assert steps_of("agent", ["agent@3", "agent2@4", "base", "agent@1", "agent@x"]) == {1, 3}
