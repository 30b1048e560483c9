"""SGLang 0.5.17's pause of generation (`/pause_generation`, `/continue_generation`) in the reference
engine. While paused, requests that arrive wait before they start (SGLang's tokenizer manager holds them);
what happens to the requests already admitted depends on the mode:

- "abort" (SGLang's default): they end at once with finish reason "abort" and what they generated so far;
  the pause returns when none is left.
- "in_place": each stops before its next decode step and keeps its KV cache; after the pause the next
  tokens are computed by whatever weights are loaded then, over the old cache.
- "retract": the same, but a held request's cache is dropped and recomputed (prompt and output so far)
  when generation continues.

Requests admitted before an "in_place" or "retract" pause are *held*: SGLang keeps them in its scheduler
(running or waiting), which then is not idle, so a cache flush there fails (`held`).

A weight update while not paused is exclusive (`exclusive`, SGLang's model-update writer lock): requests
that arrive wait, the admitted ones finish first, so every answer comes from one version of the weights.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

from .generation import GenerationRequest

PauseMode = Literal["abort", "retract", "in_place"]
_POLL_S = 0.05  # how often a waiter rechecks shutdown and its own abort


class GenerationGate:
    """Whether generation may go on, and the requests a pause holds or aborts. Its condition shares the
    engine's model lock: a request held before a decode step gives the lock up while it waits, so weight
    updates run meanwhile."""

    def __init__(self, model_lock: threading.Lock, stopping: Callable[[], bool]) -> None:
        self._cond = threading.Condition(model_lock)
        self._stopping = stopping
        self._registry = threading.Lock()
        self._in_flight: dict[int, GenerationRequest] = {}
        self._held: set[int] = set()
        self._updates = 0  # exclusive updates waiting or running
        self._late: set[int] = set()  # requests that arrived while one was: they wait for it
        self.mode: PauseMode | None = None

    @property
    def held(self) -> int:
        """How many requests admitted before the current pause have not ended."""
        with self._registry:
            return len(self._held)

    @contextlib.contextmanager
    def admitted(self, request: GenerationRequest) -> Iterator[None]:
        """Count `request` in flight (before it waits for the model lock) until it ends."""
        if request.abort is None:
            request.abort = threading.Event()
        key = id(request)
        with self._registry:
            self._in_flight[key] = request
            if self._updates:
                self._late.add(key)
        try:
            yield
        finally:
            with self._registry:
                self._in_flight.pop(key, None)
                self._held.discard(key)
                self._late.discard(key)

    def wait_open(self, request: GenerationRequest) -> None:
        """Before a request starts (model lock held): wait while paused or while an update that began
        before it arrived is pending, unless it is aborted."""
        self._wait(request, lambda: self.mode is not None or id(request) in self._late)

    def hold(self, request: GenerationRequest) -> PauseMode | None:
        """Before a decode step (model lock held): the pause mode `request` was held in, after the pause
        ended (or it was aborted); None if generation was not paused."""
        mode = self.mode
        if mode is None or mode == "abort":
            return None
        self._wait(request, lambda: self.mode is not None)
        return mode

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The block of a weight update (entered without the model lock): while paused at once; else once
        the requests admitted before it have ended, requests arriving meanwhile waiting until it is done."""
        if self.mode is not None:
            yield
            return
        with self._registry:
            self._updates += 1
            # Not the requests waiting for an earlier update: they wait for this one too (SGLang's lock
            # lets no reader in while a writer waits).
            admitted = self._in_flight.keys() - self._late
        try:
            while not self._stopping():
                with self._registry:
                    if not admitted & self._in_flight.keys():
                        break
                time.sleep(_POLL_S)
            yield
        finally:
            with self._registry:
                self._updates -= 1
                if not self._updates:
                    self._late.clear()
            with self._cond:
                self._cond.notify_all()

    def pause(self, mode: PauseMode) -> None:
        """Pause generation; returns when no admitted request computes any more (aborted ones: ended)."""
        with self._registry:
            self.mode = mode
            self._held = set(self._in_flight)
        if mode == "abort":
            self.abort_all()
            while self.held and not self._stopping():
                time.sleep(_POLL_S)
            return
        with self._cond:  # taken only while no request computes: each is held, waiting or done
            pass

    def abort_all(self) -> None:
        """End every admitted request at its next step (SGLang's `abort_all_requests`)."""
        with self._registry:
            admitted = list(self._in_flight.values())
        for request in admitted:
            assert request.abort is not None  # set on admission
            request.abort.set()

    def resume(self) -> None:
        with self._registry:
            self.mode = None
            self._held.clear()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, request: GenerationRequest, closed: Callable[[], bool]) -> None:
        while closed() and not self._stopping():
            if request.abort is not None and request.abort.is_set():
                return
            self._cond.wait(_POLL_S)
