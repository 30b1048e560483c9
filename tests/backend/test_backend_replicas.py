"""Two reference-engine replicas behind SGLang's real router (sglang-router), through the backend: every
step's adapter is served by both replicas (asked of each directly), a replica killed between steps is
taken out of routing, restarted with every adapter and put back while the other serves, a multi-turn
conversation stays on one replica, and no request ever reached a replica that lacked its adapter (read
from each replica's own request log). One backend for the module; the tests run in order."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from backend_helpers import (
    chat_lines,
    check_requests_follow_loads,
    kill_tree,
    sample_groups,
    served_by_each,
    start_when_let,
    wait_dead,
)

import art_sglang as art
from art_sglang import SGLangBackend, SGLangConfig
from art_sglang.errors import ServerStartError
from art_sglang.planning.devices import DeviceLayout
from art_sglang.serving.adapters import InferenceService
from art_sglang.serving.servers.replica_health import ReplicaRouter

pytest.importorskip("sglang_router", reason="sglang-router is in the dev extra (pip install -e '.[dev]')")
pytestmark = pytest.mark.asyncio(loop_scope="module")

ANY_CHARACTER = r"[\s\S]"  # matches the first token's text, whatever the model writes
KEY = "rollout-key"
TWO_CPU_REPLICAS = DeviceLayout(
    "cpu", "reference", (), (), "two CPU replicas for tests", replica_gpus=((), ())
)


@dataclass
class Replicated:
    backend: SGLangBackend
    model: art.TrainableModel

    @property
    def service(self) -> InferenceService:
        assert self.backend.inference is not None
        return self.backend.inference


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicated(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    path = tmp_path_factory.mktemp("replicas") / ".art"
    # With a key of the rollout clients: the gateway checks it, the replicas hold keys of their own.
    backend = SGLangBackend(path=str(path), layout=TWO_CPU_REPLICAS, sglang_config=SGLangConfig(api_key=KEY))
    model = art.TrainableModel(name="agent", project="replicas", base_model=str(tiny_model_path))
    try:
        await model.register(backend)
        yield Replicated(backend, model)
    finally:
        await backend.close()


async def train_step(replicated: Replicated, seed: int) -> int:
    groups = await sample_groups(replicated.model, seed=seed)
    result = await replicated.backend.train(replicated.model, groups, learning_rate=1e-3)
    return result.step


async def test_requests_reach_each_replica_whole(replicated: Replicated) -> None:
    """The gateway sends requests to the replicas itself (SGLang's router would leave fields out): each
    choice carries the ids its replica sampled, and a `stop_regex` ends the answer at its first token, on
    both replicas."""
    service = replicated.service
    client = replicated.model.openai_client()
    logs = [p.log_path for p in service.processes]
    before = [len(chat_lines(log)) for log in logs]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=replicated.model.get_inference_name(),
                messages=[{"role": "user", "content": f"Conversation {n}: say anything."}],
                max_tokens=8,
                temperature=0,
                extra_body={"stop_regex": [ANY_CHARACTER]},
            )
            for n in range(4)
        )
    )
    for reply in replies:
        choice = reply.choices[0]
        assert reply.usage is not None and reply.usage.completion_tokens == 1, reply
        assert (choice.finish_reason, (choice.model_extra or {}).get("matched_stop")) == (
            "stop",
            ANY_CHARACTER,
        )
        assert len((choice.model_extra or {}).get("token_ids") or []) == 1, choice
    deadline = time.monotonic() + 60
    while not all(len(chat_lines(log)) > before[i] for i, log in enumerate(logs)):
        assert time.monotonic() < deadline, "the requests did not reach both replicas"
        await asyncio.sleep(0.1)


async def test_both_replicas_serve_step_zero_behind_the_router(replicated: Replicated) -> None:
    service = replicated.service
    assert "2 inference replicas and training on CPU" in replicated.backend.layout.describe()
    assert service.router is not None and len(service.processes) == 2
    urls = {process.base_url for process in service.processes}
    assert await service.router.workers() == dict.fromkeys(urls, True)
    assert await served_by_each(service, "agent@0") == ["yes", "yes"]
    # Clients use the gateway, which picks a replica among those the router lists as healthy, with the
    # rollout clients' key; the replicas answer only their own.
    assert replicated.model.inference_base_url == service.openai_base_url
    assert "agent@0" in {m.id for m in (await replicated.model.openai_client().models.list()).data}
    wrong = openai.AsyncOpenAI(base_url=service.openai_base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(
            model="agent@0", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        for process in service.processes:
            refused = await http.get(
                f"{process.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
            )
            assert refused.status_code == 401


async def test_each_step_is_served_by_both_replicas_across_a_replica_crash(
    replicated: Replicated, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = replicated.service
    assert service.router is not None
    assert await train_step(replicated, seed=1) == 1
    assert await served_by_each(service, "agent@1") == ["yes", "yes"]

    victim = service.processes[1]
    # The replica's new start waits for `started` (an SGLang start takes minutes): the step below must not.
    started = start_when_let(monkeypatch, victim)
    killed = kill_tree(victim.pid)
    await wait_dead(victim)
    # While it is down, rollouts go on through the other replica, and the next step trains and is served
    # there; the dead one is out of the router.
    assert await train_step(replicated, seed=2) == 2
    assert await served_by_each(service, "agent@2", service.processes[:1]) == ["yes"]
    assert list(await service.router.workers()) == [service.processes[0].base_url]
    started.set()
    deadline = time.monotonic() + 120
    while not (victim.is_alive() and victim.pid != killed and len(await service.router.workers()) == 2):
        assert time.monotonic() < deadline, "the watchdog did not bring the replica back into the router"
        await asyncio.sleep(0.2)
    # Back with the step trained while it was down.
    assert await served_by_each(service, "agent@2") == ["yes", "yes"]
    assert await train_step(replicated, seed=3) == 3
    assert await served_by_each(service, "agent@3") == ["yes", "yes"]
    # Rollouts reached both replicas.
    assert all(chat_lines(p.log_path) for p in service.processes)


async def test_a_replica_whose_restart_fails_is_tried_again_after_a_pause(
    replicated: Replicated, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = replicated.service
    assert service.router is not None
    victim = service.processes[1]
    real_start = victim.start
    attempts: list[float] = []

    async def fail_once() -> None:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise ServerStartError("the replica ran out of memory (a test's failure)")
        await real_start()

    monkeypatch.setattr(victim, "start", fail_once)
    kill_tree(victim.pid)
    deadline = time.monotonic() + 120
    while not (len(attempts) == 2 and victim.is_alive() and len(await service.router.workers()) == 2):
        assert time.monotonic() < deadline, f"not back: {len(attempts)} start(s)"
        if len(attempts) == 1:
            # Between the failed start and the next, the other replica serves.
            reply = await replicated.model.openai_client().chat.completions.create(
                model=replicated.model.get_inference_name(),
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
            )
            assert reply.choices[0].message.content is not None
        await asyncio.sleep(0.2)
    # The second start came after the pause, not at the watchdog's next look (every second).
    assert attempts[1] - attempts[0] >= 5.0
    assert await served_by_each(service, replicated.model.get_inference_name()) == ["yes", "yes"]


async def test_a_dead_router_is_restarted_with_both_replicas(replicated: Replicated) -> None:
    service = replicated.service
    router = service.router
    assert router is not None
    dead = kill_tree(router.pid)
    # A request sent meanwhile is answered: the gateway reaches the replicas without the router (at most it
    # waits while the watchdog restarts the router).
    reply = await replicated.model.openai_client().chat.completions.create(
        model=replicated.model.get_inference_name(),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
    )
    assert reply.choices[0].message.content is not None
    deadline = time.monotonic() + 60
    while router.pid in (None, dead) or await _listed(router) != {
        p.base_url: True for p in service.processes
    }:
        assert time.monotonic() < deadline, "the watchdog did not restart the router with both replicas"
        await asyncio.sleep(0.2)


async def _listed(router: ReplicaRouter) -> dict[str, bool] | None:
    """The router's replicas, or None while it does not answer (starting)."""
    try:
        return await router.workers()
    except httpx.TransportError:
        return None


async def test_a_multi_turn_conversation_stays_on_its_replica(replicated: Replicated) -> None:
    service = replicated.service
    logs = [p.log_path for p in service.processes]
    before = [len(chat_lines(log)) for log in logs]
    client = replicated.model.openai_client()
    messages = [{"role": "user", "content": "Let us play a long game of words, you and I, turn by turn."}]
    for turn in range(3):
        reply = await client.chat.completions.create(
            model=replicated.model.get_inference_name(),
            messages=messages,
            max_tokens=4,  # type: ignore[arg-type]
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"Turn {turn + 2}: go on."},
        ]
    # A server writes a request's log line once the response is sent: wait for all three.
    deadline = time.monotonic() + 60
    while sum(added := [len(chat_lines(log)) - before[i] for i, log in enumerate(logs)]) < 3:
        assert time.monotonic() < deadline, added
        await asyncio.sleep(0.1)
    assert sorted(added) == [0, 3]


async def test_a_group_sharing_a_prompt_is_served_by_one_replica(replicated: Replicated) -> None:
    """GRPO groups through the gateway's prefill sharing with two replicas: each group's prefill-only
    request and its rollouts reach one replica, and the rollouts find the prompt that request computed. A
    group is told apart in the replicas' logs by its prompt's length (each group's prompt has a different
    number of words)."""
    service = replicated.service
    assert service.gateway is not None
    logs = [p.log_path for p in service.processes]
    before = [len(chat_lines(log)) for log in logs]
    counted = service.gateway.prefill_counters()
    client = replicated.model.openai_client()
    groups, size, tokens = 3, 4, 2

    async def rollout(group: int) -> None:
        words = " ".join(["stone"] * (40 + 7 * group))
        await client.chat.completions.create(
            model=replicated.model.get_inference_name(),
            messages=[{"role": "user", "content": f"Group {group} plays a game of {words}."}],
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
        )

    await asyncio.gather(*(rollout(g) for g in range(groups) for _ in range(size)))
    # A request's log line is written once its response is sent: wait for the rollouts' and the prefills'.
    deadline = time.monotonic() + 60
    while sum(len(chat_lines(log)) - before[i] for i, log in enumerate(logs)) < groups * (size + 1):
        assert time.monotonic() < deadline, [chat_lines(log)[before[i] :] for i, log in enumerate(logs)]
        await asyncio.sleep(0.1)
    counters = service.gateway.prefill_counters()
    assert counters["prefill_requests"] - counted["prefill_requests"] == groups
    assert counters["prefill_failures"] == counted["prefill_failures"]
    replicas_of: dict[int, set[int]] = {}
    rollouts: dict[int, list[dict[str, str]]] = {}
    for index, log in enumerate(logs):
        for line in chat_lines(log)[before[index] :]:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            replicas_of.setdefault(int(fields["prompt"]), set()).add(index)
            if int(fields["completion"]) == tokens:
                rollouts.setdefault(int(fields["prompt"]), []).append(fields)
    assert len(replicas_of) == groups and all(len(r) == 1 for r in replicas_of.values()), replicas_of
    for prompt, answered in rollouts.items():
        assert len(answered) == size and all(int(f["cached"]) >= prompt - 1 for f in answered), answered


async def test_no_request_reached_a_replica_without_its_adapter(replicated: Replicated) -> None:
    """Each replica's log, in order: a request on an adapter comes after that replica (in its current
    process) loaded it and before it unloaded it, and every request was answered 200."""
    for process in replicated.service.processes:
        assert check_requests_follow_loads(process.log_path, process.label) > 0
