"""Which backends can pipeline (train while rollouts run on older steps), and the step pin a lease sets."""

from __future__ import annotations

import asyncio

from art_sglang.orchestration.pipelining import pin_step, pinned_step
from art_sglang.planning.config_checks import pipelining_problem


def test_only_a_backend_without_handoff_with_gateway_and_lora_or_merged_sync_pipelines() -> None:
    assert pipelining_problem("none", gateway=True, weight_sync="lora") is None
    assert pipelining_problem("none", gateway=True, weight_sync="merged") is None  # rollouts continued
    for handoff in ("sleep", "restart"):
        problem = pipelining_problem(handoff, gateway=True, weight_sync="lora")
        assert problem is not None and f"shared_strategy={handoff!r}" in problem
        assert "shared_strategy='co_resident'" in problem
    assert "gateway=True" in (pipelining_problem("none", gateway=False, weight_sync="lora") or "")
    for method in ("disk", "restart"):
        assert "weight_sync_method='lora'" in (
            pipelining_problem("none", gateway=True, weight_sync=method) or ""
        )


async def test_a_pin_holds_in_its_task_and_the_tasks_it_starts_only() -> None:
    seen: dict[str, int | None] = {}

    async def rollout(key: str) -> None:
        await asyncio.sleep(0)
        seen[key] = pinned_step("m")

    async def leased(step: int) -> None:
        async with pin_step("m", step):
            await asyncio.gather(rollout(f"child-{step}"))
            seen[f"self-{step}"] = pinned_step("m")
        seen[f"after-{step}"] = pinned_step("m")

    await asyncio.gather(leased(1), leased(2), rollout("outside"))
    assert seen == {
        "child-1": 1, "child-2": 2, "self-1": 1, "self-2": 2, "after-1": None, "after-2": None, "outside": None,
    }  # fmt: skip
    assert pinned_step("other") is None
