"""The reference engine's gate between requests and weight updates (art_sglang_reference/pausing.py), as
SGLang 0.5.17's tokenizer manager orders them: an update while not paused waits for the requests admitted
before it, and a request arriving while updates are pending waits for all of them; a pause holds what
arrives until generation continues. Threads stand for the HTTP layer's worker threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from art_sglang_reference.generation import GenerationRequest
from art_sglang_reference.pausing import GenerationGate
from art_sglang_reference.sampling import SamplingOptions


class Engine:
    """The gate and model lock as the engine uses them, and the order things happened in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gate = GenerationGate(self.lock, lambda: False)
        self.log: list[str] = []
        self.threads: list[threading.Thread] = []

    def request(self, name: str, seconds: float) -> None:
        def run() -> None:
            request = GenerationRequest([1], SamplingOptions())
            with self.gate.admitted(request), self.lock:
                self.gate.wait_open(request)
                self.log.append(f"{name} starts")
                time.sleep(seconds)
                self.log.append(f"{name} ends")

        self._start(run)

    def update(self, name: str) -> None:
        def run() -> None:
            with self.gate.exclusive(), self.lock:
                self.log.append(f"update {name}")

        self._start(run)

    def _start(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target)
        thread.start()
        self.threads.append(thread)
        time.sleep(0.1)  # each in turn: the order the test means

    def finish(self) -> list[str]:
        for thread in self.threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in self.threads), f"stuck: {self.log}"
        return self.log


def test_an_update_waits_for_the_admitted_request_and_holds_the_arriving_one() -> None:
    engine = Engine()
    engine.request("r0", 0.5)
    engine.update("A")
    engine.request("r1", 0.0)
    assert engine.finish() == ["r0 starts", "r0 ends", "update A", "r1 starts", "r1 ends"]


def test_a_request_arriving_during_an_update_waits_for_the_next_one_too() -> None:
    engine = Engine()
    engine.request("r0", 0.5)
    engine.update("A")
    engine.request("r1", 0.0)
    engine.update("B")
    log = engine.finish()
    assert log[:2] == ["r0 starts", "r0 ends"]
    assert sorted(log[2:4]) == ["update A", "update B"]  # the two updates in either order
    assert log[4:] == ["r1 starts", "r1 ends"]


def test_a_pause_holds_arriving_requests_and_updates_run_during_it() -> None:
    engine = Engine()
    engine.gate.pause("in_place")
    engine.request("r0", 0.0)
    engine.update("A")  # paused: at once
    engine.gate.resume()
    assert engine.finish() == ["update A", "r0 starts", "r0 ends"]
