"""The order in which prefill sharing lets a prompt's requests go, with the upstream replaced by a function
the test answers when it wants: the first waits for company up to the lead (a partner the loop took in as
the lead ran out still finds it); the second starts exactly one prefill-only request; everyone waiting goes
once it returns, whatever it returned; later ones go at once;
a caller that leaves takes nobody with it; the prompt is forgotten after a while."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from art_sglang.serving.gateway import prefill_sharing
from art_sglang.serving.gateway.prefill_sharing import Answer, PrefillSharing, prompt_key
from art_sglang.serving.gateway.rules import Forward

pytestmark = pytest.mark.asyncio

PAYLOAD = {"model": "agent@1", "messages": [{"role": "user", "content": "move"}], "max_tokens": 8}


class Upstream:
    """Records the prefill-only requests and answers each when the test sets `answer`."""

    def __init__(self, status: int = 200, fail: bool = False) -> None:
        self.bodies: list[dict] = []
        self.answer = asyncio.Event()
        self.status = status
        self.fail = fail

    async def __call__(self, decision: Forward, headers: dict[str, str]) -> Answer:
        self.bodies.append(json.loads(decision.body))
        await self.answer.wait()
        if self.fail:
            raise RuntimeError("the connection broke")
        return Answer(self.status, json.dumps({"usage": {"prompt_tokens": 40}}).encode())


def _request(**changes: object) -> tuple[str, Forward]:
    payload = {**PAYLOAD, **changes}
    decision = Forward("/v1/chat/completions", json.dumps(payload).encode(), ("agent@1",), payload=payload)
    key = prompt_key(decision)
    assert key is not None
    return key, decision


def _turn(sharing: PrefillSharing, **changes: object) -> asyncio.Task[None]:
    key, decision = _request(**changes)
    return asyncio.create_task(sharing.wait_turn(key, decision, {}))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_group_waits_for_one_prefill_and_later_requests_go_at_once() -> None:
    upstream = Upstream()
    sharing = PrefillSharing(upstream, lead=30.0)
    first = _turn(sharing)
    await _settle()
    assert not first.done() and upstream.bodies == []  # waiting for company, nothing sent
    others = [_turn(sharing, seed=s, max_tokens=3) for s in range(3)]  # sampling differs: same prompt
    await _settle()
    assert len(upstream.bodies) == 1 and upstream.bodies[0]["max_tokens"] == 0
    assert "seed" not in upstream.bodies[0]
    assert not any(t.done() for t in (first, *others))
    upstream.answer.set()
    await asyncio.wait_for(asyncio.gather(first, *others), 5)
    await asyncio.wait_for(_turn(sharing), 5)  # the prompt is computed: no wait, no second prefill
    assert len(upstream.bodies) == 1
    assert sharing.counters.as_dict() == {
        "requests_held": 4,
        "prefill_requests": 1,
        "prefill_tokens_saved": 3 * 40,
        "prefill_failures": 0,
        "requests_alone": 0,
    }


async def test_a_lone_request_waits_the_lead_and_no_prefill_is_sent() -> None:
    upstream = Upstream()
    started = asyncio.get_running_loop().time()
    waited = PrefillSharing(upstream, lead=0.2)
    await asyncio.wait_for(_turn(waited), 5)
    assert asyncio.get_running_loop().time() - started >= 0.19 and waited.counters.requests_alone == 1
    sharing = PrefillSharing(upstream, lead=0.0)
    await asyncio.wait_for(_turn(sharing), 0.1)
    assert upstream.bodies == [] and sharing.counters.requests_alone == 0  # it never waited


async def test_a_partner_taken_in_as_the_lead_ran_out_finds_the_first_waiting() -> None:
    upstream = Upstream()
    sharing = PrefillSharing(upstream, lead=0.01)
    first = _turn(sharing)
    await _settle()

    async def partner(turns: int) -> None:  # a request the gateway took in, a few loop turns from wait_turn
        for _ in range(turns):
            await asyncio.sleep(0)
        await sharing.wait_turn(*_request(), {})

    time.sleep(0.05)  # the loop is busy past the first's deadline (its thread held up, say)
    second = asyncio.create_task(partner(prefill_sharing.GRACE_TURNS - 2))
    for _ in range(prefill_sharing.GRACE_TURNS + 2):
        await asyncio.sleep(0)
    assert not first.done() and len(upstream.bodies) == 1  # the first did not go alone
    upstream.answer.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert sharing.counters.requests_held == 2 and sharing.counters.requests_alone == 0


async def test_with_no_lead_the_first_goes_at_once_and_the_rest_wait_for_the_prefill() -> None:
    upstream = Upstream()
    sharing = PrefillSharing(upstream, lead=0.0)
    await asyncio.wait_for(_turn(sharing), 1)
    second, third = _turn(sharing), _turn(sharing)
    await _settle()
    assert len(upstream.bodies) == 1 and not second.done() and not third.done()
    upstream.answer.set()
    await asyncio.wait_for(asyncio.gather(second, third), 5)
    assert sharing.counters.prefill_tokens_saved == 40  # two waited: one prompt computation saved


@pytest.mark.parametrize("upstream", [Upstream(status=400), Upstream(fail=True)], ids=["refused", "broken"])
async def test_whatever_the_prefill_returns_everyone_goes_on(upstream: Upstream) -> None:
    sharing = PrefillSharing(upstream, lead=30.0)
    waiting = [_turn(sharing) for _ in range(3)]
    await _settle()
    upstream.answer.set()
    await asyncio.wait_for(asyncio.gather(*waiting), 5)  # each request then meets the error itself
    assert sharing.counters.prefill_requests == 0 and sharing.counters.prefill_failures == 1


async def test_a_caller_that_leaves_takes_nobody_with_it() -> None:
    upstream = Upstream()
    sharing = PrefillSharing(upstream, lead=30.0)
    waiting = [_turn(sharing) for _ in range(3)]
    await _settle()
    waiting[1].cancel()
    await _settle()
    assert not waiting[0].done() and not waiting[2].done() and len(upstream.bodies) == 1
    upstream.answer.set()
    await asyncio.wait_for(asyncio.gather(waiting[0], waiting[2]), 5)
    assert sharing.counters.prefill_requests == 1


async def test_a_prompt_is_forgotten_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_sharing, "PROMPT_MEMORY_S", 0.05)
    upstream = Upstream()
    sharing = PrefillSharing(upstream, lead=0.0)
    await _turn(sharing)
    await asyncio.sleep(0.1)
    # Taken as the first of its prompt again: the cache may have dropped it, and it goes alone at once.
    await asyncio.wait_for(_turn(sharing), 0.1)
    assert upstream.bodies == []


async def test_a_negative_lead_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        PrefillSharing(Upstream(), lead=-1.0)
