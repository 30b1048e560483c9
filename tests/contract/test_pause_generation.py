"""Generation paused and continued around a weight update (merged-weight rollouts, issue 40), as SGLang
0.5.17 does it. A pause holds the requests that arrive; the ones running are aborted ("abort", SGLang's
default: they end with what they have) or held before their next decode step ("in_place", "retract") and
go on after `/continue_generation`. SGLang 0.5.17 reports one weight version per answer, the one loaded
when it finished, so only abort-and-resend tells which weights sampled which token; and its scheduler
cannot flush the cache while a pause holds requests, which takes the server down after an update that
asks for the flush."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from contract_helpers import MESSAGES, chat, contract_config, running_server, wait_until_dead
from weight_push import PROMPT_IDS, Asked, Pusher, Streamed, assert_same, from_disk, greedy, paused

from art_sglang.serving.servers.process import ServerProcess

LONG = 1500  # tokens: a generation still running when the test pauses it
HELD = 12  # requests held at once: more than a thread pool of the reference engine has threads


@pytest.fixture
def base_weights(pusher: Pusher, model_path: str) -> Iterator[None]:
    """The test starts and ends on the base weights, version "v0"."""
    pusher.push_ok(model=model_path, version="v0")
    yield
    pusher.push_ok(model=model_path, version="v0")


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_a_paused_engine_holds_new_requests_and_continues_them(
    client: httpx.Client, server: ServerProcess, base_weights: None, mode: str
) -> None:
    expected = greedy(client)
    with paused(client, mode):
        asked = Asked(server.base_url)
        time.sleep(1.0)
        assert not asked.answers  # held while paused
    assert_same(asked.answer(), expected)


def test_an_update_and_the_continue_come_through_however_many_requests_a_pause_holds(
    client: httpx.Client, server: ServerProcess, pusher: Pusher, base_weights: None, perturbed: str
) -> None:
    """A merged push meets the requests that arrived since its pause (a pipelined trainer's rollouts): more
    than the reference engine's worker threads (6 on 2 cores) must not keep the update or the continue
    from running."""
    with paused(client, "abort"):
        held = [Asked(server.base_url) for _ in range(HELD)]
        time.sleep(1.0)
        assert not any(asked.answers for asked in held)
        pusher.push_ok(model=perturbed, version="v1")
    assert {asked.answer().weight_version for asked in held} == {"v1"}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_running_request_is_held_and_goes_on(
    client: httpx.Client, server: ServerProcess, base_weights: None, mode: str
) -> None:
    expected = greedy(client, max_new_tokens=LONG).output_ids
    stream = Streamed(server.base_url, LONG)
    stream.wait_for(5)
    with paused(client, mode):
        held = stream.still(0.5)
        time.sleep(1.0)
        assert stream.output_ids == held and len(held) < LONG  # nothing generated while paused
    final = stream.final()
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert final["output_ids"][: len(held)] == expected[: len(held)]
    if mode == "in_place":  # the same cache and weights: the same tokens (a retracted request's
        assert final["output_ids"] == expected  # recomputed cache may round differently on a GPU)


def test_an_update_without_a_pause_waits_for_the_running_requests(
    client: httpx.Client, server: ServerProcess, pusher: Pusher, base_weights: None, perturbed: str
) -> None:
    """Unpaused, SGLang runs an update under its model-update writer lock: the requests admitted before it
    finish on the old weights, the ones arriving meanwhile wait and get the new: no answer mixes two."""
    expected = greedy(client, max_new_tokens=LONG).output_ids
    stream = Streamed(server.base_url, LONG)
    stream.wait_for(5)
    pushing = threading.Thread(target=lambda: pusher.push_ok(model=perturbed, version="v1"))
    pushing.start()
    time.sleep(0.5)  # the update is waiting for the stream
    later = Asked(server.base_url)
    final = stream.final()
    pushing.join(120)
    # Every token of the running request from v0; the request that arrived during the wait on v1.
    assert final["output_ids"] == expected and final["meta_info"]["weight_version"] == "v0"
    assert later.answer().weight_version == "v1"


def test_abort_and_resend_samples_the_rest_with_the_new_weights(
    client: httpx.Client, server: ServerProcess, pusher: Pusher, base_weights: None, perturbed: str
) -> None:
    """SGLang 0.5.17's way to know which weights sampled each token: the update aborts the running request
    (its tokens so far: the old version), and the rest is asked for again under the new one."""
    stream = Streamed(server.base_url, LONG)
    stream.wait_for(5)
    with paused(client, "abort"):
        aborted = stream.final()
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert aborted["meta_info"]["weight_version"] == "v0"
        partial = aborted["output_ids"]
        assert 5 <= len(partial) < LONG
        pusher.push_ok(model=perturbed, version="v1")  # the scheduler is idle: the flush succeeds
    resent = greedy(client, input_ids=PROMPT_IDS + partial)
    assert resent.weight_version == "v1"
    from_disk(client, perturbed, "v1")
    assert_same(greedy(client, input_ids=PROMPT_IDS + partial), resent)  # exactly the new weights' tokens


def test_a_held_request_reports_the_version_it_finished_under(
    client: httpx.Client, server: ServerProcess, pusher: Pusher, base_weights: None, perturbed: str
) -> None:
    expected = greedy(client, max_new_tokens=LONG).output_ids
    stream = Streamed(server.base_url, LONG)
    stream.wait_for(5)
    with paused(client, "in_place"):
        held = stream.still(0.5)
        # Without the flush: SGLang cannot flush while it holds a request (see below).
        pusher.push_ok(model=perturbed, version="v1", flush=False)
    final = stream.final()
    assert final["output_ids"][: len(held)] == expected[: len(held)]  # sampled by v0...
    assert final["output_ids"] != expected  # ...the rest by v1 over v0's cache
    assert final["meta_info"]["weight_version"] == "v1"  # one version for the whole answer


def test_a_cache_flush_while_a_pause_holds_requests_ends_the_server(
    engine: str, model_path: str, tmp_path: Path
) -> None:
    """SGLang 0.5.17 flushes after an update (`flush_cache` defaults to true) and asserts the flush
    worked; with a request held by an "in_place" or "retract" pause it cannot, and the scheduler's
    assertion takes the server down. A backend that updates under such a pause must pass
    flush_cache=false."""
    with running_server(contract_config(engine), model_path, engine, tmp_path / "server.log") as proc:
        with httpx.Client(base_url=proc.base_url, timeout=120.0, trust_env=False) as http:
            stream = Streamed(proc.base_url, LONG)
            stream.wait_for(5)
            assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        pusher = Pusher(proc.base_url)
        try:
            [answer] = pusher.push(model=model_path, version="v1")
        finally:
            pusher.close()
        assert answer["status"] is None  # the connection dropped
        wait_until_dead(proc)
        assert "Cache flush failed after updating weights" in proc.log_tail(400)


def test_an_aborted_chat_answer_carries_what_its_continuation_needs(
    client: httpx.Client, server: ServerProcess, base_weights: None
) -> None:
    """What the gateway continues a non-streamed rollout from (serving/gateway/resend.py): the prompt's and
    the sampled ids, a logprob per sampled token, the version that sampled them."""
    answers: list[httpx.Response] = []
    body = {"max_tokens": LONG, "ignore_eos": True, "return_token_ids": True, "logprobs": True}

    def ask() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120.0, trust_env=False) as own:
            answers.append(chat(own, **body))

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    time.sleep(1.0)  # generating
    with paused(client, "abort"):
        asking.join(60)
    [answer] = answers
    assert answer.status_code == 200, answer.text
    [choice] = answer.json()["choices"]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < LONG and choice["prompt_token_ids"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert answer.json()["metadata"]["weight_version"] == "v0"


def test_continue_final_message_goes_on_from_the_assistant_text(
    client: httpx.Client, model_path: str
) -> None:
    """What the gateway continues a streamed chat from (serving/gateway/stream_resend.py): the prompt's ids,
    then the assistant text's encoding (no BOS), and the answer goes on from there."""
    from transformers import AutoTokenizer

    text = "The alphabet starts with"
    plain = chat(client, max_tokens=1, return_token_ids=True)
    turn = [*MESSAGES, {"role": "assistant", "content": text}]
    going_on = chat(client, max_tokens=1, return_token_ids=True, messages=turn, continue_final_message=True)
    assert going_on.status_code == 200, going_on.text
    encoded = AutoTokenizer.from_pretrained(model_path).encode(text, add_special_tokens=False)
    prompt = plain.json()["choices"][0]["prompt_token_ids"]
    assert going_on.json()["choices"][0]["prompt_token_ids"] == prompt + encoded
